"""The run-time side of the attention variants: what the references apply to the logits.

A ``Problem`` says which variants are on and the values that shape the work (the window's
bounds, the softcap); the values that are data (ALiBi slopes, sink logits, a caller's
softmax scale) come with each call. ``VariantValues`` holds both, as the float64 reference,
the numpy emulation and the precision peers apply them, in FlashAttention's conventions and
in this order (FlashAttention-2's kernel applies them so):

1. scaled logits ``s = q.k * scale`` (``scale`` None: ``1/sqrt(head_dim)``);
2. softcap: ``s = softcap * tanh(s / softcap)`` (0: off);
3. ALiBi: ``s -= slope_h * |r + off - k|`` for query head ``h`` (``off = kv_len - seq_len``);
4. the mask: query row ``r`` sees keys ``k`` in ``[r + off - window_left, r + off +
   window_right]`` (``-1``: that side unbounded), causal bounds the right side at
   ``r + off``; a row that sees no key has output 0;
5. sinks: one logit ``sink_h`` per query head joins the softmax's denominator only:
   ``out_r = sum_k e^(s_rk - m) v_k / (sum_k e^(s_rk - m) + e^(sink_h - m))``.

The log-sum-exp of a row is ``log(sum_k e^(s_rk) + e^(sink_h))`` in natural-log units; a row
with no visible key and no sink has ``+inf`` (FlashAttention's convention: a backward pass
computing ``e^(s - lse)`` then gets 0, never NaN).

``alibi_slopes(heads)`` are the standard slopes (BLOOM's ``build_alibi_tensor``, which
FlashAttention's tests use): for a power-of-two head count ``2^(-8(h+1)/heads)``; otherwise
the slopes of the largest power of two below the count, then every other slope of twice that
count for the heads left over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tuner.problem import UNBOUNDED, Problem

#: log2(e): the kernels work on exp2, with the scale folded into the logits
LOG2E = math.log2(math.e)


def alibi_slopes(heads: int) -> np.ndarray:
    """The standard ALiBi slope of each of ``heads`` query heads (float64, ``[heads]``)."""
    if heads < 1:
        raise ValueError(f"heads={heads} must be >= 1")
    closest = 1 << (heads.bit_length() - 1)  # the largest power of two <= heads
    slopes = [2.0 ** (-8.0 * (h + 1) / closest) for h in range(closest)]
    # The heads past the power of two: the odd-numbered slopes of twice as many heads.
    slopes += [2.0 ** (-4.0 * power / closest) for power in range(1, 2 * (heads - closest), 2)]
    return np.array(slopes, dtype=np.float64)


@dataclass(frozen=True, eq=False)
class VariantValues:
    """The variants of one problem with their run-time values; the defaults are none."""

    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    softcap: float = 0.0
    #: one slope per query head, ``[heads]``; None: no ALiBi
    alibi_slopes: np.ndarray | None = None
    #: one logit per query head, ``[heads]`` (natural-log units, like the scaled logits)
    sinks: np.ndarray | None = None
    #: the softmax scale; None: ``1/sqrt(head_dim)``
    scale: float | None = None

    @classmethod
    def of(
        cls,
        problem: Problem,
        alibi_slopes: npt.ArrayLike | None = None,
        sinks: npt.ArrayLike | None = None,
        scale: float | None = None,
    ) -> VariantValues:
        """``problem``'s variants with their values: slopes and sinks of ``[heads]`` exactly
        when the problem has ALiBi and sinks (``ValueError`` otherwise)."""
        return cls(
            problem.window_left,
            problem.window_right,
            problem.softcap,
            _per_head("alibi_slopes", problem.alibi, alibi_slopes, problem.heads),
            _per_head("sinks", problem.sinks, sinks, problem.heads),
            scale,
        )

    @property
    def any(self) -> bool:
        """Whether anything differs from plain attention (windows, softcap, ALiBi, sinks or
        a scale of its own)."""
        return (
            self.window_left != UNBOUNDED
            or self.window_right != UNBOUNDED
            or self.softcap > 0
            or self.alibi_slopes is not None
            or self.sinks is not None
            or self.scale is not None
        )

    def scale_for(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.scale is None else float(self.scale)

    def sink(self, head: int) -> float | None:
        """The sink logit of flattened (batch, query head) index ``head``, or None."""
        return None if self.sinks is None else float(self.sinks[head % len(self.sinks)])


def _per_head(
    name: str, wanted: bool, values: npt.ArrayLike | None, heads: int
) -> np.ndarray | None:
    if not wanted:
        if values is not None:
            raise ValueError(f"{name} given for a problem without that variant")
        return None
    if values is None:
        raise ValueError(f"the problem has {name.split('_')[0]} but no {name} were given")
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.shape != (heads,):
        raise ValueError(f"{name} has {array.size} values; the problem has {heads} query heads")
    return array


def visible_keys(
    rows: np.ndarray,
    kv_len: int,
    offset: int,
    causal: bool,
    window_left: int = UNBOUNDED,
    window_right: int = UNBOUNDED,
) -> np.ndarray:
    """``[rows, kv_len]`` booleans: which keys each query row sees (module doc, step 4)."""
    keys = np.arange(kv_len)[None, :]
    diagonal = np.asarray(rows)[:, None] + offset
    seen = np.ones((len(rows), kv_len), dtype=bool)
    if causal:
        seen &= keys <= diagonal
    if window_left != UNBOUNDED:
        seen &= keys >= diagonal - window_left
    if window_right != UNBOUNDED:
        seen &= keys <= diagonal + window_right
    return seen


def problem_visible_keys(problem: Problem, rows: np.ndarray) -> np.ndarray | None:
    """``visible_keys`` of ``problem``'s rows ``rows`` (None: every key, no mask at all)."""
    if not (problem.causal or problem.windowed):
        return None
    return visible_keys(
        rows, problem.kv_len, problem.causal_offset, problem.causal, problem.window_left,
        problem.window_right,
    )


def transform_logits(
    scores: np.ndarray,
    rows: np.ndarray,
    offset: int,
    head: int,
    variants: VariantValues,
) -> np.ndarray:
    """Softcap, then the ALiBi bias, applied to scaled logits ``[rows, keys]`` of flattened
    (batch, query head) index ``head`` (module doc, steps 2 and 3), in ``scores``' dtype."""
    if variants.softcap > 0:
        cap = scores.dtype.type(variants.softcap)
        scores = cap * np.tanh(scores / cap)
    if variants.alibi_slopes is not None:
        slope = variants.alibi_slopes[head % len(variants.alibi_slopes)]
        distance = np.abs(np.asarray(rows)[:, None] + offset - np.arange(scores.shape[-1]))
        scores = scores - (scores.dtype.type(slope) * distance).astype(scores.dtype)
    return scores
