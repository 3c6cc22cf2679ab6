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
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.attention_args import AttentionInputTypeError, check_traced
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
    if out is None:
        return attention_op(q, k, v, causal, registry_url, nearest, precision, *variants)
    attention_into_op(q, k, v, out, causal, registry_url, nearest, precision, *variants)
    return out
