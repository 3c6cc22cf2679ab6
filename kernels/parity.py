"""Is a kernel's output right? Comparison rules and the per-problem CPU reference.

A kernel output passes when every element is finite and within the seed's
absolute tolerance (``FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS``) of the reference.
Outputs are poisoned with NaN before each run, so an element the kernel never
wrote is still NaN and fails, as does any NaN or inf the kernel produced.

Small problems (``batch*heads*seq_len**2*head_dim <= FULL_CHECK_WORK``) are
compared whole against float64 attention; larger ones on sampled heads and
rows (the first and last rows always among them) so the CPU side costs
milliseconds. The GPU backend adds, for large problems, a whole-output
comparison with the scalar kernel on the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kernels.attention_variants import VariantValues
from kernels.reference import attention_reference, reference_rows
from tuner.planner.seed import FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
from tuner.problem import Problem

#: multiply-adds of one q.k^T of the whole problem above which the CPU check samples
FULL_CHECK_WORK = 2**28
SAMPLED_HEADS = 2
SAMPLED_ROWS = 64


@dataclass(frozen=True, slots=True)
class ParityResult:
    ok: bool
    #: largest |output - reference| over the compared elements; inf when any is non-finite
    max_abs_error: float
    detail: str = ""


def full_check(problem: Problem) -> bool:
    work = problem.batch_heads * problem.seq_len * problem.kv_len * problem.head_dim
    return work <= FULL_CHECK_WORK


def sample_indices(
    problem: Problem,
    rng: np.random.Generator,
    heads: int = SAMPLED_HEADS,
    rows: int = SAMPLED_ROWS,
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted head and row indices to check; the first and last of each are always kept.

    The last row sees every key (the longest causal row) and the first sees one,
    so both ends of the masking and of the row-block tail are covered.
    """
    bh, n = problem.batch_heads, problem.seq_len
    head_picks = {0, bh - 1} | set(rng.choice(bh, size=min(heads, bh), replace=False).tolist())
    row_picks = {0, n - 1} | set(rng.choice(n, size=min(rows, n), replace=False).tolist())
    return np.array(sorted(head_picks)), np.array(sorted(row_picks))


def non_finite(output: np.ndarray) -> ParityResult | None:
    """A failure naming the non-finite elements (count, first index), or None if all are finite."""
    bad = ~np.isfinite(output)
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), output.shape))
    return ParityResult(
        False,
        math.inf,
        f"{count} non-finite elements (NaN: unwritten or computed), first at {where}",
    )


def compare(
    output: np.ndarray,
    expected: np.ndarray,
    tolerance: float = FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS,
    against: str = "reference",
) -> ParityResult:
    if output.shape != expected.shape:
        raise ValueError(f"output shape {output.shape} != {against} shape {expected.shape}")
    if (failure := non_finite(output)) is not None:
        return failure
    if output.size == 0:
        return ParityResult(True, 0.0)
    error = np.abs(output.astype(np.float64) - expected)
    worst = float(error.max())
    if worst <= tolerance:
        return ParityResult(True, worst)
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(error)), error.shape))
    return ParityResult(
        False, worst, f"max |error| {worst:.3g} vs {against} > {tolerance:g} at {where}"
    )


class CpuReference:
    """The float64 reference of one problem's inputs, computed once and reused per candidate.

    ``variants``: the problem's variants with the slopes and sinks the kernel runs with
    (default: the problem's own, which suffices unless it has ALiBi or sinks).
    """

    def __init__(
        self,
        problem: Problem,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        seed: int = 0,
        variants: VariantValues | None = None,
    ) -> None:
        self.problem = problem
        self.variants = VariantValues.of(problem) if variants is None else variants
        self.full = full_check(problem)
        shape = (problem.batch_heads, problem.seq_len, problem.head_dim)
        kv_shape = (problem.batch_kv_heads, problem.kv_len, problem.head_dim)
        q, k, v = q.reshape(shape), k.reshape(kv_shape), v.reshape(kv_shape)
        if self.full:
            self.heads = np.arange(problem.batch_heads)
            self.rows = np.arange(problem.seq_len)
            self.expected = attention_reference(
                q, k, v, problem.causal, problem.group, self.variants
            )
        else:
            self.heads, self.rows = sample_indices(problem, np.random.default_rng(seed))
            self.expected = reference_rows(
                q, k, v, problem.causal, self.heads, self.rows, problem.group, self.variants
            )

    def select(self, output: np.ndarray) -> np.ndarray:
        """The part of a full output that the reference covers."""
        shape = (self.problem.batch_heads, self.problem.seq_len, self.problem.head_dim)
        whole = output.reshape(shape)
        return whole if self.full else whole[np.ix_(self.heads, self.rows)]

    def check(
        self, output: np.ndarray, tolerance: float = FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
    ) -> ParityResult:
        # Non-finite elements anywhere fail, sampled or not.
        if (failure := non_finite(output)) is not None:
            return failure
        against = "float64 reference" if self.full else "float64 reference (sampled rows)"
        return compare(self.select(output), self.expected, tolerance, against)
