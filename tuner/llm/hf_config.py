"""A Hugging Face ``config.json``'s attention fields -> ``ModelAttention`` (pure).

``attention_from_fields(fields, name)`` reads the fields below from a mapping (a
parsed ``config.json``, or a ``tuner/conf/model/`` option, which writes the same
fields). A field that is absent or null takes its default; a field that is present
but unusable raises ``ConfigFieldError`` naming it.

======================  ===============================================  ====================
field                   meaning                                          absent or null
======================  ===============================================  ====================
num_attention_heads     query heads                                      required
num_key_value_heads     KV heads (grouped-query attention)               num_attention_heads
head_dim                per-head dimension                               hidden_size / heads
hidden_size             only for head_dim's default                      (required then)
num_hidden_layers       layers                                           len(layer_types)
sliding_window          keys a sliding layer's token sees, itself too    no layer slides
use_sliding_window      Qwen2: false switches sliding_window off         true
layer_types             per layer full_attention or sliding_attention    the rule below
sliding_window_pattern  Gemma 3, Cohere 2: every pattern-th layer full   the rule below
max_window_layers       Qwen2: the layers from this index on slide       the rule below
attn_logit_softcapping  Gemma 2's logit softcap                          0 (none)
query_pre_attn_scalar   softmax scale 1/sqrt(this) (Gemma 2 and 3)       head_dim
model_type              names the rules below                            ""
======================  ===============================================  ====================

A sliding layer's token sees the ``sliding_window`` keys up to itself (transformers'
masks: ``key > query - sliding_window``), FlashAttention's ``window_left =
sliding_window - 1``. Which layers slide (with a ``sliding_window`` and
``use_sliding_window`` not false),
the first rule that applies, as the models' code in transformers decides it:
``layer_types`` as given; ``sliding_window_pattern``: layer ``i`` slides unless ``(i + 1)
% pattern == 0``; ``max_window_layers``: layer ``i`` slides when ``i >= max_window_layers``
(Qwen2's attention code; its docstring says the opposite); ``model_type`` gemma2: every
other layer, from layer 0 (Gemma2's ``layer_idx % 2 == 0``, the alternating rule
its config.json does not spell out); otherwise every layer (Mistral).

Attention sinks have no config field: every layer of ``model_type`` gpt_oss has them.
A config that wraps its language model (``text_config``, as Gemma 3 and Llama 4 do) is
read from there when the top level has no ``num_attention_heads``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from tuner.llm.attention import ModelAttention

#: what ``layer_types`` may say per layer
LAYER_TYPES = ("full_attention", "sliding_attention")
#: model types whose layers alternate sliding/full without a field saying so
ALTERNATING_MODEL_TYPES = ("gemma2",)
#: model types whose every layer has attention sinks (learned, one per query head)
SINK_MODEL_TYPES = ("gpt_oss",)
#: the fields ``attention_from_fields`` reads
FIELDS = (
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "sliding_window_pattern",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
)
_U32_MAX = 2**32 - 1


class ConfigFieldError(ValueError):
    """A field of a model config that cannot be used: which, its value, and why.

    ``value`` is None for a required field that is absent; ``why`` reads after the
    field's name and value (``must divide num_attention_heads=32``).
    """

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"{field}={value!r} {why}")
        self.field = field
        self.value = value
        self.why = why


def language_model_fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The mapping that holds the attention fields: ``config`` itself, or its
    ``text_config`` when only that has ``num_attention_heads``."""
    text = config.get("text_config")
    if config.get("num_attention_heads") is None and isinstance(text, Mapping):
        return text
    return config


def attention_from_fields(fields: Mapping[str, Any], name: str) -> ModelAttention:
    """The attention of the model whose config has ``fields``; ``ConfigFieldError`` if unusable."""
    heads = _count(fields, "num_attention_heads", required=True)
    assert heads is not None
    kv_heads = _count(fields, "num_key_value_heads") or heads
    if heads % kv_heads:
        raise ConfigFieldError(
            "num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}"
        )
    head_dim = _count(fields, "head_dim") or _head_dim_from_hidden_size(fields, heads)
    softcap = _number(fields, "attn_logit_softcapping", minimum=0.0, inclusive=True)
    scalar = _number(fields, "query_pre_attn_scalar", minimum=0.0, inclusive=False)
    model_type = _model_type(fields)
    return ModelAttention(
        name=name,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        layer_windows=layer_windows(fields),
        scale=1.0 / math.sqrt(head_dim if scalar is None else scalar),
        softcap=softcap or 0.0,
        sinks=model_type in SINK_MODEL_TYPES,
    )


def layer_windows(fields: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Per layer, the keys a token sees (itself included), or None for every earlier key."""
    types = _layer_types(fields)
    layers = _count(fields, "num_hidden_layers")
    if types is not None:
        if layers is not None and len(types) != layers:
            raise ConfigFieldError(
                "layer_types",
                types,
                f"must have one entry per layer (num_hidden_layers={layers})",
            )
        layers = len(types)
    if layers is None:
        raise ConfigFieldError("num_hidden_layers", None, "is missing (and so is layer_types)")
    window = _count(fields, "sliding_window")
    enabled = _flag(fields, "use_sliding_window", default=True)
    if window is None or not enabled:
        if types is not None and enabled and "sliding_attention" in types:
            first = types.index("sliding_attention")
            raise ConfigFieldError(
                f"layer_types[{first}]", types[first], "needs a sliding_window, which is null"
            )
        return (None,) * layers
    slides = _sliding_rule(fields, types)
    return tuple(window if slides(layer) else None for layer in range(layers))


def _sliding_rule(fields: Mapping[str, Any], types: list[str] | None) -> Callable[[int], bool]:
    if types is not None:
        return lambda layer: types[layer] == "sliding_attention"
    pattern = _count(fields, "sliding_window_pattern")
    if pattern is not None:
        return lambda layer: (layer + 1) % pattern != 0
    full_below = _count(fields, "max_window_layers", minimum=0)
    if full_below is not None:
        return lambda layer: layer >= full_below
    if _model_type(fields) in ALTERNATING_MODEL_TYPES:
        return lambda layer: (layer + 1) % 2 != 0
    return lambda layer: True


def _head_dim_from_hidden_size(fields: Mapping[str, Any], heads: int) -> int:
    hidden = _count(fields, "hidden_size")
    if hidden is None:
        raise ConfigFieldError(
            "head_dim", None, "is missing, and so is hidden_size (head_dim = hidden_size / heads)"
        )
    if hidden % heads:
        raise ConfigFieldError(
            "hidden_size",
            hidden,
            f"must be a multiple of num_attention_heads={heads} when head_dim is missing",
        )
    return hidden // heads


def _layer_types(fields: Mapping[str, Any]) -> list[str] | None:
    types = fields.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list | tuple) or not types:
        raise ConfigFieldError("layer_types", types, "must be a non-empty list, one per layer")
    for index, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise ConfigFieldError(
                f"layer_types[{index}]", kind, f"must be one of {', '.join(LAYER_TYPES)}"
            )
    return list(types)


def _count(
    fields: Mapping[str, Any], field: str, *, required: bool = False, minimum: int = 1
) -> int | None:
    value = fields.get(field)
    if value is None:
        if required:
            raise ConfigFieldError(field, None, "is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _U32_MAX:
        raise ConfigFieldError(field, value, f"must be an integer >= {minimum}")
    return value


def _number(
    fields: Mapping[str, Any], field: str, *, minimum: float, inclusive: bool
) -> float | None:
    value = fields.get(field)
    if value is None:
        return None
    number_ok = isinstance(value, int | float) and not isinstance(value, bool)
    if (
        not number_ok
        or not math.isfinite(value)
        or value < minimum
        or (not inclusive and value == minimum)
    ):
        sign = ">=" if inclusive else ">"
        raise ConfigFieldError(field, value, f"must be a number {sign} {minimum:g}")
    return float(value)


def _flag(fields: Mapping[str, Any], field: str, *, default: bool) -> bool:
    value = fields.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigFieldError(field, value, "must be true or false")
    return value


def _model_type(fields: Mapping[str, Any]) -> str:
    value = fields.get("model_type")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigFieldError("model_type", value, "must be a string")
    return value
