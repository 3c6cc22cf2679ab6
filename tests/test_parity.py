"""Parity rules (NaN never passes, the seed's tolerance, sampling) and the timing summary."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernels.parity import (
    FULL_CHECK_WORK,
    CpuReference,
    compare,
    full_check,
    sample_indices,
)
from kernels.reference import attention_reference
from kernels.timing import summarize, throughput, time_repetitions
from tuner.device import H200
from tuner.planner.seed import FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
from tuner.planner.tunable import KernelParams, plan_kernel
from tuner.problem import Problem


def inputs(problem: Problem) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    shape = (problem.batch_heads, problem.seq_len, problem.head_dim)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]


def test_tolerance_is_the_seeds() -> None:
    expected = np.zeros((2, 3))
    assert compare(expected + 0.9e-3, expected).ok
    result = compare(expected + 1.1e-3, expected)
    assert not result.ok
    assert result.max_abs_error == pytest.approx(1.1e-3)
    assert "1.1e-03" in result.detail or "0.0011" in result.detail
    assert FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS == 1e-3


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_output_never_passes(bad: float) -> None:
    expected = np.zeros((2, 3, 4))
    output = expected.copy()
    output[1, 2, 3] = bad
    result = compare(output, expected, tolerance=math.inf)
    assert not result.ok
    assert result.max_abs_error == math.inf
    assert "(1, 2, 3)" in result.detail


def test_samples_keep_first_and_last_rows_and_heads() -> None:
    problem = Problem(4096, 128, batch=4, heads=16)
    heads, rows = sample_indices(problem, np.random.default_rng(0))
    assert heads[0] == 0 and heads[-1] == 63 and len(heads) <= 4
    assert rows[0] == 0 and rows[-1] == 4095 and 64 <= len(rows) <= 66
    assert (np.diff(rows) > 0).all() and (np.diff(heads) > 0).all()


def test_samples_of_a_tiny_problem_are_everything() -> None:
    heads, rows = sample_indices(Problem(3, 8), np.random.default_rng(0))
    assert heads.tolist() == [0] and rows.tolist() == [0, 1, 2]


def test_full_check_threshold() -> None:
    assert full_check(Problem(1000, 64, batch=2, heads=2))
    assert not full_check(Problem(4096, 128))
    assert full_check(Problem(2**10, 2**8))  # exactly 2**28
    assert FULL_CHECK_WORK == 2**28


@pytest.mark.parametrize("problem", [Problem(40, 16, heads=3), Problem(4096, 32, causal=True)])
def test_cpu_reference_passes_the_truth_and_fails_a_wrong_row(problem: Problem) -> None:
    q, k, v = inputs(problem)
    reference = CpuReference(problem, q, k, v)
    truth = reference_output(problem, q, k, v, reference)
    assert reference.check(truth).ok
    wrong = truth.copy()
    wrong[reference.heads[-1], reference.rows[-1], 0] += 0.01
    result = reference.check(wrong)
    assert not result.ok and result.max_abs_error == pytest.approx(0.01, rel=1e-3)


def reference_output(problem, q, k, v, reference: CpuReference) -> np.ndarray:
    if reference.full:
        return attention_reference(q, k, v, problem.causal).astype(np.float32)
    # Sampled: fill only what the reference looks at; the rest is finite garbage.
    out = np.zeros_like(q)
    out[np.ix_(reference.heads, reference.rows)] = reference.expected
    return out


def test_an_unwritten_element_outside_the_sample_still_fails() -> None:
    problem = Problem(4096, 32)
    q, k, v = inputs(problem)
    reference = CpuReference(problem, q, k, v)
    assert not reference.full
    output = reference_output(problem, q, k, v, reference)
    unsampled = next(r for r in range(problem.seq_len) if r not in set(reference.rows))
    output[0, unsampled, 5] = np.nan
    result = reference.check(output)
    assert not result.ok and "non-finite" in result.detail


def test_summary_is_median_and_interquartile_range() -> None:
    stats = summarize([5.0, 1.0, 2.0, 3.0, 4.0])
    assert stats.median_ms == 3.0
    assert stats.spread_ms == pytest.approx(2.0)  # 4 - 2
    assert stats.samples_ms == (5.0, 1.0, 2.0, 3.0, 4.0)
    assert stats.relative_spread == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        summarize([])


class FakeTimer:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def start(self) -> None:
        self.log.append("start")

    def stop(self) -> float:
        self.log.append("stop")
        return 1.5


def test_every_repetition_is_flushed_outside_its_timed_region() -> None:
    log: list[str] = []
    stats = time_repetitions(
        lambda: log.append("run"),
        FakeTimer(log),
        repetitions=3,
        warmup=2,
        flush=lambda: log.append("flush"),
    )
    assert log == ["flush", "run"] * 2 + ["flush", "start", "run", "stop"] * 3
    assert stats.samples_ms == (1.5, 1.5, 1.5)


def test_throughput_counts_useful_flops_and_planned_bytes() -> None:
    problem = Problem(4096, 128, batch=4, heads=16)
    params = KernelParams("tiled", threads=128, tile_size=64, rows_per_block=64, split_target=64)
    plan = plan_kernel(problem, params, H200)
    tflops, gbps = throughput(problem, plan, 10.0)
    assert tflops == pytest.approx(4 * 64 * 4096**2 * 128 / 1e-2 / 1e12)
    assert gbps == pytest.approx(plan.global_bytes / 1e-2 / 1e9)
    assert throughput(problem, None, 10.0)[1] == 0.0
