"""The project's attention inside Hugging Face transformers (5.17 on), an optional extra.

    pip install '.[transformers]'

    import kernels.transformers_attention as tuned
    name = tuned.register()        # "tuned_attention"; registry=URL for a registry of your own
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name,
                                             dtype=torch.bfloat16).cuda()
    model.generate(input_ids, max_new_tokens=64)

``register`` puts two functions under one name: the attention function in transformers'
``AttentionInterface`` and a mask function in its ``AttentionMaskInterface`` (a name the mask
interface does not know gets no mask at all, padding included, so both are needed). The name
must not contain ``flash_attention`` (transformers 5.17 takes such names for hub kernels).

What reaches ``kernels.attention``: transformers passes q ``[batch, heads, q_len, head_dim]``
and the cache's k, v ``[batch, kv_heads, kv_len, head_dim]`` (GQA as it is: the kernels read
fewer KV heads, nothing is repeated); ``module.is_causal`` (or the call's ``is_causal``) is
causal masking aligned bottom-right, as a KV cache is; ``sliding_window=W`` (Mistral, Qwen2,
Gemma 2/3, gpt-oss pass it, as transformers' own FlashAttention path needs it too) is
``window=(W - 1, -1)``: a token sees W keys up to itself, transformers' ``kv > q - W``;
``softcap`` (Gemma 2) is ``softcap``; ``s_aux`` (gpt-oss's sinks, one logit per query head in the
scaled logits' units) is ``sinks``, as float32; ``scaling`` is ``scale``. q is made contiguous when
it is not (a prefill's q is a transposed view); the output goes back as ``[batch, q_len, heads,
head_dim]``, the transposed view, which the models' ``reshape`` takes as it is.

The mask function returns no mask (None) when the attention is exactly what those arguments
say: a causal mask (plus the layer's window) whose last query is the last key (a dynamic or
sliding-window cache, a prefill) or a full bidirectional one, with no padding among the visible
keys. Anything else (left-padded batches, a static cache's empty slots, packed sequences,
custom mask functions) gets the boolean mask torch's SDPA would get, and a call with a mask
falls back: to transformers' SDPA, or where SDPA cannot express the layer (softcap, sinks) to
the model's own eager attention, with one logged line (logger ``kernels.transformers``) per
reason. So do calls the kernels cannot take: tensors off the GPU, dropout in training, a
gradient (the kernels have no backward pass), ``output_attentions``, and a problem
``kernels.attention`` refuses.

Decode is one query row against a cache one key longer each step: a new KV length at every
call. ``kernels.attention`` chooses plans per KV bucket (``kernels.kv_buckets``); a call with
more than one query row (a prefill) also resolves the decode problem its next token poses, so
the first decode step finds its bucket resolved (``register(prepare_decode=False)`` turns that
off).

Importing this module imports torch and transformers; ``import kernels`` imports neither.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask, sdpa_mask

from kernels.attention_args import problem_from_shapes
from kernels.deploy import Attention, default_instance
from kernels.variant_args import NO_WINDOW
from tuner.errors import TunerError

#: the name models are built with: ``attn_implementation=ATTENTION_NAME``
ATTENTION_NAME = "tuned_attention"
#: the first transformers release this integration is written and tested against
OLDEST_TRANSFORMERS = (5, 17)

logger = logging.getLogger("kernels.transformers")


class IntegrationError(TunerError, ValueError):
    """The integration cannot be registered or cannot serve a layer; the message says why."""


def transformers_version() -> tuple[int, int]:
    major, minor, *_ = (transformers.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def register(
    name: str = ATTENTION_NAME,
    *,
    registry: str | None = None,
    nearest: bool = True,
    prepare_decode: bool = True,
) -> str:
    """Register the project's attention under ``name`` with transformers; returns ``name``.

    ``registry``: a registry URL (None: the tuner's default registry, as ``kernels.attention``);
    ``nearest``: serve the nearest tuned shape when a bucket has no plan of its own (a model
    tuned with ``python -m tuner model=...`` has decode plans at its ``decode_kv_lengths``).
    """
    if transformers_version() < OLDEST_TRANSFORMERS:
        raise IntegrationError(
            f"transformers {transformers.__version__} is older than "
            f"{'.'.join(map(str, OLDEST_TRANSFORMERS))}, the first release this integration "
            "supports: pip install '.[transformers]'"
        )
    if "flash_attention" in name or "/" in name or name in ("sdpa", "eager", "flex_attention"):
        raise IntegrationError(
            f"attention name {name!r} is taken by transformers (names containing "
            "'flash_attention' or '/' load hub kernels); choose another, e.g. "
            f"{ATTENTION_NAME!r}"
        )
    attention = TransformersAttention(registry, nearest=nearest, prepare_decode=prepare_decode)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, unmasked_when_expressible)
    return name


# --------------------------------------------------------------------------- the mask


def _aligned(q_length: int, kv_length: int, q_offset: Any, kv_offset: Any) -> bool:
    """Whether the last query is the last key (bottom-right causal alignment)."""
    return (
        isinstance(q_offset, int)
        and isinstance(kv_offset, int)
        and q_offset + q_length == kv_offset + kv_length
    )


def _unpadded(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> bool:
    """Whether no visible key is padding (one host synchronisation when a mask is given, as
    transformers' SDPA mask makes)."""
    if attention_mask is None:
        return True
    if torch.compiler.is_compiling():
        return False  # a data-dependent answer would break the graph: keep the mask
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    visible = padding[:, kv_offset : kv_offset + kv_length]
    return bool(visible.all())


def unmasked_when_expressible(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask function registered beside the attention: None where the attention function's
    own arguments say the whole mask (see the module doc), else SDPA's boolean mask.

    ``allow_is_causal_skip`` is transformers' word that the mask is causal (plus the layer's
    ``local_size`` window) and nothing else (no custom or packed-sequence mask function);
    ``allow_is_bidirectional_skip`` that it is bidirectional and nothing else."""
    causal = allow_is_causal_skip and _aligned(q_length, kv_length, q_offset, kv_offset)
    bidirectional = allow_is_bidirectional_skip and local_size is None
    if (causal or bidirectional) and _unpadded(attention_mask, kv_length, kv_offset):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        **kwargs,
    )


# --------------------------------------------------------------------------- the attention


def visible_mask(
    q_length: int, kv_length: int, causal: bool, window_left: int, device: torch.device
) -> torch.Tensor | None:
    """``[1, 1, q_length, kv_length]`` booleans of the keys each query sees (bottom-right
    causal, the window's left bound), or None where every query sees every key."""
    if not causal and window_left < 0:
        return None
    diagonal = torch.arange(q_length, device=device)[:, None] + (kv_length - q_length)
    keys = torch.arange(kv_length, device=device)[None, :]
    seen = keys <= diagonal if causal else torch.ones_like(keys <= diagonal)
    if window_left >= 0:
        seen = seen & (keys >= diagonal - window_left)
    return seen[None, None]


class LayerArguments(NamedTuple):
    """What a layer's call says of its attention, as ``kernels.attention`` takes it."""

    causal: bool
    window: tuple[int, int]
    softcap: float
    scale: float | None


def layer_arguments(
    module: torch.nn.Module,
    is_causal: bool | None,
    sliding_window: int | None,
    softcap: float | None,
    scaling: float | None,
) -> LayerArguments:
    """The call's ``is_causal`` (else ``module.is_causal``, else causal), its sliding window
    of W keys up to the query as ``window=(W - 1, -1)``, its softcap (None: 0) and scale."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = NO_WINDOW if not sliding_window else (int(sliding_window) - 1, -1)
    cap = float(softcap) if softcap else 0.0
    return LayerArguments(causal, window, cap, None if scaling is None else float(scaling))


class TransformersAttention:
    """The attention function registered with transformers (``register``); a callable with
    the signature of ``transformers.integrations.sdpa_attention.sdpa_attention_forward``."""

    def __init__(
        self, registry: str | None = None, *, nearest: bool = True, prepare_decode: bool = True
    ) -> None:
        self.registry = registry
        self.nearest = nearest
        self.prepare_decode = prepare_decode
        self._attention: Attention | None = None
        self._sinks: dict[int, tuple[int, int, torch.Tensor]] = {}
        self._reasons: set[str] = set()
        self._lock = threading.Lock()

    @property
    def attention(self) -> Attention:
        """The shared ``kernels.Attention`` of the registry (as ``kernels.attention`` uses)."""
        if self._attention is None:
            self._attention = default_instance(self.registry, nearest=self.nearest)
        return self._attention

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        s_aux: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        layer = layer_arguments(module, is_causal, sliding_window, softcap, scaling)
        causal, window = layer.causal, layer.window
        reason = self._refusal(module, query, key, attention_mask, dropout, causal, window, kwargs)
        if not reason:
            sinks = None if s_aux is None else self._float_sinks(s_aux)
            try:
                out = self.attention(
                    query if query.is_contiguous() else query.contiguous(),
                    key if key.is_contiguous() else key.contiguous(),
                    value if value.is_contiguous() else value.contiguous(),
                    causal,
                    window=window,
                    softcap=layer.softcap,
                    sinks=sinks,
                    scale=layer.scale,
                )
            except TunerError as error:  # a problem no plan serves: the model's own path
                reason = f"kernels.attention refused it: {error}"
            else:
                if self.prepare_decode and query.shape[2] > 1 and causal:
                    self._prepare_decode(query, key, layer, sinks is not None)
                return out.transpose(1, 2), None
        self._log_once(reason)
        return fallback(
            module, query, key, value, attention_mask, dropout, scaling, causal, window[0],
            layer.softcap, s_aux, kwargs,
        )

    def _refusal(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float,
        causal: bool,
        window: tuple[int, int],
        kwargs: dict[str, Any],
    ) -> str:
        """Why this call cannot go to the kernels ("" when it can)."""
        if attention_mask is not None:
            return (
                "a mask the kernels' arguments cannot say (padding, a static cache's empty "
                "slots, packed sequences or a custom mask)"
            )
        if query.device.type != "cuda":
            return f"tensors on {query.device.type}, not a CUDA GPU"
        if dropout and module.training:
            return f"attention dropout {dropout} in training"
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
            return "a gradient is asked for and the kernels have no backward pass"
        if kwargs.get("output_attentions"):
            return "output_attentions asks for the attention weights"
        if not causal and window != NO_WINDOW:
            return "a sliding window without causal masking"
        return ""

    def _float_sinks(self, s_aux: torch.Tensor) -> torch.Tensor:
        """``s_aux`` as float32 ``[heads]``: a copy kept per parameter until it changes."""
        if torch.compiler.is_compiling():
            return s_aux.float().contiguous()
        kept = self._sinks.get(id(s_aux))
        if kept is not None and kept[0] == s_aux._version and kept[1] == s_aux.data_ptr():
            return kept[2]
        copy = s_aux.detach().float().contiguous()
        self._sinks[id(s_aux)] = (s_aux._version, s_aux.data_ptr(), copy)
        return copy

    def _prepare_decode(
        self, query: torch.Tensor, key: torch.Tensor, layer: LayerArguments, sinks: bool
    ) -> None:
        """Resolve the problem the next decode step poses: one query row against one key
        more, or for a sliding layer against the W keys transformers' sliding-window cache
        keeps (its W - 1 latest and the new one)."""
        if torch.compiler.is_compiling():
            return
        batch, heads, _, head_dim = query.shape
        kv_heads, kv_len = key.shape[1], key.shape[2]
        window_left = layer.window[0]
        kept = kv_len if window_left < 0 else min(kv_len, window_left)
        try:
            problem = problem_from_shapes(
                (batch, heads, 1, head_dim),
                (batch, kv_heads, kept + 1, head_dim),
                _DTYPES[query.dtype],
                True,
                window_left=window_left,
                window_right=layer.window[1],
                softcap=layer.softcap,
                sinks=sinks,
            )
            self.attention.handle(problem, query.device.index or 0)
        except TunerError as error:  # the decode call itself will say it, and fall back
            self._log_once(f"the next decode step could not be prepared: {error}")

    def _log_once(self, reason: str) -> None:
        with self._lock:
            if reason in self._reasons:
                return
            self._reasons.add(reason)
        logger.warning("kernels.attention not used for this call (falling back): %s", reason)


_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def fallback(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    causal: bool,
    window_left: int,
    softcap: float,
    s_aux: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Any]:
    """The call on transformers' SDPA, or on the model's eager attention where SDPA cannot
    express the layer (softcap, sinks). With no mask given, the causal and window mask the
    kernels would have applied is built here (SDPA's own ``is_causal`` is aligned top-left)."""
    mask = attention_mask
    if mask is None:
        mask = visible_mask(query.shape[2], key.shape[2], causal, window_left, query.device)
    if not softcap and s_aux is None:
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling,
            is_causal=False, **kwargs,
        )
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise IntegrationError(
            f"{type(module).__name__} has softcap or sinks, which SDPA cannot express, and its "
            "module has no eager_attention_forward to fall back to"
        )
    additive = None
    if mask is not None:
        lowest = torch.finfo(query.dtype).min
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        additive = additive.masked_fill(~mask, lowest)
    return eager(
        module, query, key, value, additive, dropout=dropout,
        scaling=scaling if scaling is not None else 1 / math.sqrt(query.shape[-1]),
        softcap=softcap or None, s_aux=s_aux, **kwargs,
    )
