"""The attention geometry of a model: what every one of its layers computes.

A ``ModelAttention`` is read from a Hugging Face config (``tuner.llm.hf_config``); it
holds, per layer, the sliding window that bounds what a token sees, and the settings
every layer shares (heads, KV heads, head_dim, logit softcap, sinks, softmax scale).
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.problem import UNBOUNDED


@dataclass(frozen=True, slots=True)
class ModelAttention:
    """One model's attention, layer by layer.

    ``layer_windows[i]`` is the number of keys a token of layer ``i`` sees, itself
    included (Hugging Face's ``sliding_window``: ``key > query - sliding_window``), or
    None where the layer sees every earlier key. ``scale`` is the softmax scale the
    model multiplies q.k by: ``1/sqrt(query_pre_attn_scalar)`` where the config sets
    that (Gemma 2 and 3), else ``1/sqrt(head_dim)``. It is run-time data, not part of
    what is tuned.
    """

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]
    scale: float
    softcap: float = 0.0
    sinks: bool = False

    @property
    def layers(self) -> int:
        return len(self.layer_windows)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, window in enumerate(self.layer_windows) if window is not None)

    def window_left(self, layer: int) -> int:
        """FlashAttention's ``window_left`` of ``layer``: keys before the token's own that
        it sees (``sliding_window - 1``), or -1 for every earlier key."""
        window = self.layer_windows[layer]
        return UNBOUNDED if window is None else window - 1

    def describe(self) -> str:
        """``32 layers, 32 query heads on 8 KV heads, head_dim 128`` and the variants."""
        parts = [
            f"{self.layers} layers, {self.heads} query heads on {self.kv_heads} KV heads, "
            f"head_dim {self.head_dim}"
        ]
        windows = sorted({w for w in self.layer_windows if w is not None})
        if windows:
            sliding = len(self.sliding_layers)
            which = "every layer" if sliding == self.layers else f"{sliding} of the layers"
            parts.append(f"sliding window {'/'.join(map(str, windows))} on {which}")
        if self.softcap:
            parts.append(f"logit softcap {self.softcap:g}")
        if self.sinks:
            parts.append("attention sinks")
        return ", ".join(parts)
