"""``kernels.attention`` as torch custom ops, so ``torch.compile`` and CUDA graphs take it.

Two ops in the ``flash_attention_tuner`` namespace (``torch.library.custom_op``, torch >= 2.4):

* ``attention(q, k, v, causal, registry, nearest, precision, window_left, window_right,
  softcap, alibi_slopes, sinks, scale) -> Tensor``: a new output;
* ``attention_into(q, k, v, out, causal, registry, nearest, precision, window_left,
  window_right, softcap, alibi_slopes, sinks, scale) -> ()``: fills ``out`` (declared
  mutated, so functionalisation sees the write).

``registry`` is a URL or None (an op's arguments must be values torch knows); the window is
two ints (``kernels.attention``'s ``window=(left, right)``), ``alibi_slopes`` and ``sinks``
optional float32 ``[heads]`` tensors, ``scale`` an optional float. The real implementations
(CUDA) are the eager path: the shared ``Attention`` of that registry
(``kernels.deploy.default_instance``), its cached handle, a launch on torch's current stream;
they allocate nothing but the output and never wait for the GPU, so inductor's CUDA graphs
(``mode="reduce-overhead"``) capture them. The fake implementations run the argument checks that
need no storage (``attention_args.check_traced``, ``variant_args.check_variants``: shapes,
dtypes, devices of q, k, v, out, the slopes and the sinks) and return an empty tensor like q,
so shapes and dtypes propagate through a traced graph.

``kernels.deploy.Attention.__call__`` calls ``traced_call`` when ``torch.compiler.is_compiling()``:
``torch.compile(fullgraph=True)`` of a model that calls ``kernels.attention`` puts one op node in
the graph where the call was. Importing this module imports torch; ``import kernels`` does not
import it.

Training (bfloat16/float16 inputs of which one requires grad, grad mode on) takes two more ops:

* ``attention_with_lse(q, k, v, causal, registry, nearest) -> (out, lse)``: the forward, with
  each row's log-sum-exp (float32 ``[batch, heads, seq_len]``); its autograd formula
  (``register_autograd``) saves q, k, v, out and lse and calls
* ``attention_backward(dout, q, k, v, out, lse, causal, registry, nearest, deterministic) ->
  (dq, dk, dv)``, deterministic when ``torch.are_deterministic_algorithms_enabled()``.

Both have fake implementations, so AOTAutograd traces a training step's joint graph with them
(``torch.compile(fullgraph=True)`` of forward + ``backward()``); like the others they allocate
only their outputs and scratch from torch's allocator and never wait, so CUDA graphs take them.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.attention_args import (
    AttentionInputTypeError,
    check_differentiable_dtype,
    check_traced,
    differentiable,
    wants_grad,
)
from kernels.variant_args import (
    NO_WINDOW,
    check_scale,
    check_softcap,
    check_variants,
    check_window,
)

NAMESPACE = "flash_attention_tuner"


@torch.library.custom_op(f"{NAMESPACE}::attention", mutates_args=(), device_types="cuda")
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    registry: str | None,
    nearest: bool,
    precision: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    from kernels.deploy import default_instance

    return default_instance(registry, nearest=nearest)(
        q,
        k,
        v,
        causal,
        precision=precision,
        window=(window_left, window_right),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        scale=scale,
    )


@attention_op.register_fake
def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    registry: str | None,
    nearest: bool,
    precision: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    inputs = check_traced(q, k, v)
    window = (window_left, window_right)
    check_variants(inputs, window, softcap, alibi_slopes, sinks, scale, pointers=False)
    return torch.empty_like(q)


@torch.library.custom_op(
    f"{NAMESPACE}::attention_into", mutates_args=("out",), device_types="cuda"
)
def attention_into_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    registry: str | None,
    nearest: bool,
    precision: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> None:
    from kernels.deploy import default_instance

    default_instance(registry, nearest=nearest)(
        q,
        k,
        v,
        causal,
        out=out,
        precision=precision,
        window=(window_left, window_right),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        scale=scale,
    )


@attention_into_op.register_fake
def _attention_into_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    causal: bool,
    registry: str | None,
    nearest: bool,
    precision: str | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> None:
    inputs = check_traced(q, k, v, out)
    window = (window_left, window_right)
    check_variants(inputs, window, softcap, alibi_slopes, sinks, scale, pointers=False)


# ---------------------------------------------------------------------------- training


@torch.library.custom_op(
    f"{NAMESPACE}::attention_with_lse", mutates_args=(), device_types="cuda"
)
def attention_with_lse_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    registry: str | None,
    nearest: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.deploy import default_instance

    return default_instance(registry, nearest=nearest).attention_with_lse(q, k, v, causal)


@attention_with_lse_op.register_fake
def _attention_with_lse_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    registry: str | None,
    nearest: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_traced(q, k, v)
    check_differentiable_dtype(str(q.dtype).removeprefix("torch."))
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(
    f"{NAMESPACE}::attention_backward", mutates_args=(), device_types="cuda"
)
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    registry: str | None,
    nearest: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernels.deploy import default_instance

    attend = default_instance(registry, nearest=nearest)
    return attend.attention_backward(dout, q, k, v, out, lse, causal, deterministic)


@attention_backward_op.register_fake
def _attention_backward_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    registry: str | None,
    nearest: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_traced(q, k, v, out)
    check_traced(dout, k, v)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    q, k, v, causal, registry, nearest = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # the LSE is for the backward, not a result to train on
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.registry, ctx.nearest = causal, registry, nearest


def _backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor) -> tuple[Any, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        ctx.causal,
        ctx.registry,
        ctx.nearest,
        torch.are_deterministic_algorithms_enabled(),
    )
    return dq, dk, dv, None, None, None


attention_with_lse_op.register_autograd(_backward, setup_context=_setup_context)


def differentiable_call(
    registry_url: str | None,
    registry: Any,
    nearest: bool,
    q: Any,
    k: Any,
    v: Any,
    causal: Any,
) -> torch.Tensor:
    """A call that autograd differentiates (eager or traced): ``attention_with_lse``'s output;
    the LSE stays with autograd for the backward."""
    if registry_url is None and registry is not None:
        raise AttentionInputTypeError(
            "a differentiable call needs the registry as a URL or None, not an open registry "
            f"handle ({type(registry).__name__}): pass its URL"
        )
    if not isinstance(causal, bool):
        raise AttentionInputTypeError(f"causal must be a bool, got {causal!r}")
    out, _ = attention_with_lse_op(q, k, v, causal, registry_url, nearest)
    return out


def traced_call(
    registry_url: str | None,
    registry: Any,
    nearest: bool,
    q: Any,
    k: Any,
    v: Any,
    causal: Any,
    out: Any,
    precision: str | None = None,
    window: Any = NO_WINDOW,
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    scale: Any = None,
) -> torch.Tensor:
    """The call while torch.compile traces: the op in its place. ``registry``: what the caller
    named (a URL, None, or an open handle, which an op cannot take). The variants' plain values
    are checked here, where the message reaches the caller, and passed as the op's types."""
    if registry_url is None and registry is not None:
        raise AttentionInputTypeError(
            "under torch.compile the registry must be a URL or None, not an open registry "
            f"handle ({type(registry).__name__}): pass its URL"
        )
    if not isinstance(causal, bool):
        raise AttentionInputTypeError(f"causal must be a bool, got {causal!r}")
    if precision is not None and not isinstance(precision, str):
        raise AttentionInputTypeError(f"precision must be a str or None, got {precision!r}")
    window_left, window_right = check_window(window)
    capped = check_softcap(softcap)
    custom = None if check_scale(scale) is None else float(scale)
    variants = (window_left, window_right, capped, alibi_slopes, sinks, custom)
    tensors = all(isinstance(x, torch.Tensor) for x in (q, k, v))
    if tensors and wants_grad(q, k, v, torch) and differentiable(q, out, precision, torch):
        if variants != (*NO_WINDOW, 0.0, None, None, None):
            raise AttentionInputTypeError(
                "gradients through a window, softcap, ALiBi, sinks or a custom scale are not "
                "implemented yet (the backward kernels take them; the autograd op does not)"
            )
        return differentiable_call(registry_url, registry, nearest, q, k, v, causal)
    if out is None:
        return attention_op(q, k, v, causal, registry_url, nearest, precision, *variants)
    attention_into_op(q, k, v, out, causal, registry_url, nearest, precision, *variants)
    return out
