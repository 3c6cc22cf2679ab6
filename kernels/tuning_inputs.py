"""What a problem is tuned (and its parity checked) on: seeded inputs, ALiBi slopes, sinks.

Every problem gets random normal q, k, v rounded to its dtype (``kernels.precision``); a
problem without variants gets exactly the draws it always got. The variants add what a kernel
that ignored them would be caught by:

* softcap: q and k have a standard deviation of ``sqrt(SOFTCAP_LOGIT_STD)``, so the scaled
  logits ``q.k / sqrt(head_dim)`` have one of ``SOFTCAP_LOGIT_STD`` and reach several hundred
  in every row (unit inputs give logits near 1, which a cap of 50 never touches);
* ALiBi: the standard slopes of the head count (``kernels.attention_variants.alibi_slopes``),
  as float32, what the kernel reads;
* sinks: one float32 logit per query head around the typical log-sum-exp of a row
  (``typical_row_lse``): each head's sink is ``SINK_OFFSETS`` above it, drawn uniformly, so
  the sink takes between 27% and 95% of a typical row's softmax weight in every head. A kernel
  that ignored sinks would then be off by at least a third of its output in every sampled
  head, far above any dtype's tolerance. (Sinks near the row's largest logit, e.g. a normal
  around it, would hold only ``1/keys`` of the weight of a long row: invisible.)

The reference and the kernel see the same values: the slopes and sinks are drawn (and rounded
to float32) once here, the backend uploads them and gives them to ``kernels.parity``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kernels import precision
from kernels.attention_variants import VariantValues, alibi_slopes
from kernels.reference import reference_rows
from tuner.problem import Problem

#: the standard deviation of the scaled logits of a softcap problem's inputs
SOFTCAP_LOGIT_STD = 100.0
#: each head's sink lies this far (natural-log units, drawn uniformly) above the typical row
#: log-sum-exp: a share of e^x / (1 + e^x) of the row's weight, 27% to 95%
SINK_OFFSETS = (-1.0, 3.0)
#: rows (of the first heads) the typical log-sum-exp is taken over
TYPICAL_ROWS = 32
TYPICAL_HEADS = 4


@dataclass(frozen=True, eq=False)
class TuningInputs:
    """q, k, v as stored on the device and as float32 values; the variants with the values
    the kernel gets (float32 slopes and sinks, the default scale)."""

    stored: tuple[np.ndarray, np.ndarray, np.ndarray]
    values: tuple[np.ndarray, np.ndarray, np.ndarray]
    variants: VariantValues

    @property
    def alibi_slopes(self) -> np.ndarray | None:
        """The float32 slopes to upload, or None."""
        slopes = self.variants.alibi_slopes
        return None if slopes is None else slopes.astype(np.float32)

    @property
    def sinks(self) -> np.ndarray | None:
        """The float32 sink logits to upload, or None."""
        sinks = self.variants.sinks
        return None if sinks is None else sinks.astype(np.float32)


def input_spread(problem: Problem) -> float:
    """The standard deviation of q's and k's elements: 1, or for a softcap problem what
    makes the scaled logits' standard deviation ``SOFTCAP_LOGIT_STD``."""
    return math.sqrt(SOFTCAP_LOGIT_STD) if problem.softcap > 0 else 1.0


def tuning_inputs(problem: Problem, rng: np.random.Generator) -> TuningInputs:
    """The inputs of ``problem`` from ``rng`` (see the module doc); q ``[batch*heads, seq_len,
    head_dim]``, k and v ``[batch*kv_heads, kv_len, head_dim]``."""
    stored, values = precision.random_inputs(problem, rng, input_spread(problem))
    slopes = None
    if problem.alibi:
        slopes = alibi_slopes(problem.heads).astype(np.float32).astype(np.float64)
    sinks = None
    if problem.sinks:
        without_sinks = VariantValues(
            problem.window_left, problem.window_right, problem.softcap, slopes
        )
        typical = typical_row_lse(problem, *values, without_sinks)
        offsets = rng.uniform(*SINK_OFFSETS, size=problem.heads)
        sinks = (typical + offsets).astype(np.float32).astype(np.float64)
    variants = VariantValues.of(problem, alibi_slopes=slopes, sinks=sinks)
    return TuningInputs(tuple(stored), tuple(values), variants)  # type: ignore[arg-type]


def typical_row_lse(
    problem: Problem, q: np.ndarray, k: np.ndarray, v: np.ndarray, variants: VariantValues
) -> float:
    """The median log-sum-exp under ``variants`` (give them without sinks) of rows spread
    over the first heads: what a sink competes with. Rows that see no key are left out."""
    heads = np.arange(min(TYPICAL_HEADS, problem.batch_heads))
    rows = np.unique(np.linspace(0, problem.seq_len - 1, TYPICAL_ROWS).astype(np.int64))
    _, lse = reference_rows(q, k, v, problem.causal, heads, rows, problem.group, variants, lse=True)
    finite = lse[np.isfinite(lse)]
    return float(np.median(finite)) if finite.size else 0.0
