"""Timing sanity: repeated measurements of one plan agree, and one outlier cannot move them.

* On the device (``gpu``-marked, skipped where pycuda or a CUDA device is missing):
  one plan measured 30 times with L2 flushes has an interquartile range under 2% of
  its median (moved here from tests/test_gpu_parity.py), and a 10x outlier planted
  among those real samples moves the reported median by under 1%.
* On the CPU: the same summary (``kernels.timing.summarize``, reached through the
  timing loop ``time_repetitions`` as the backend reaches it) on scripted samples.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR, PyCudaBackend
from kernels.timing import TimingStats, summarize, time_repetitions
from tuner.errors import BackendError
from tuner.planner.tunable import KernelParams, plan_kernel
from tuner.problem import Problem

CACHE_DIR = os.environ.get("FLASH_ATTENTION_TUNER_CUBIN_CACHE", DEFAULT_CACHE_DIR)
REPETITIONS = 30


class ScriptedTimer:
    """An event timer that reports the given milliseconds, one per timed run."""

    def __init__(self, samples_ms: list[float]) -> None:
        self.samples = iter(samples_ms)
        self.running = False

    def start(self) -> None:
        assert not self.running
        self.running = True

    def stop(self) -> float:
        assert self.running
        self.running = False
        return next(self.samples)


def timed(samples_ms: list[float]) -> TimingStats:
    runs: list[int] = []
    stats = time_repetitions(
        lambda: runs.append(1),
        ScriptedTimer(samples_ms),
        repetitions=len(samples_ms),
        warmup=2,
        flush=lambda: None,
    )
    assert len(runs) == len(samples_ms) + 2
    return stats


def with_outlier(samples_ms: tuple[float, ...] | list[float], at: int) -> list[float]:
    """The samples with the one at ``at`` replaced by 10x the largest."""
    planted = list(samples_ms)
    planted[at] = 10 * max(samples_ms)
    return planted


@pytest.mark.parametrize("at", [0, REPETITIONS // 2, REPETITIONS - 1])
def test_a_planted_10x_outlier_moves_the_median_by_under_1_percent(at: int) -> None:
    rng = np.random.default_rng(at)
    # A kernel of 0.25 ms with 0.5% jitter: the spread of a quiet GPU.
    samples = [float(x) for x in rng.normal(0.25, 0.25 * 0.005, REPETITIONS)]
    clean = timed(samples)
    planted = timed(with_outlier(samples, at))
    assert abs(planted.median_ms - clean.median_ms) / clean.median_ms < 0.01
    assert planted.relative_spread < 0.02  # the IQR ignores it too
    assert max(planted.samples_ms) == 10 * max(samples)  # it was kept, not dropped


def test_the_median_and_spread_are_the_middle_and_the_interquartile_range() -> None:
    stats = summarize([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (stats.median_ms, stats.spread_ms) == (3.0, 2.0)
    assert stats.relative_spread == pytest.approx(2 / 3)
    assert summarize([1.0] * 4).relative_spread == 0.0
    with pytest.raises(ValueError, match="no timing samples"):
        summarize([])


def test_a_third_of_outliers_is_not_hidden() -> None:
    """The median is robust to a few outliers, not blind: when they are a third of the
    samples the spread says so (the timing is not trusted silently)."""
    samples = [0.25] * 20 + [2.5] * 10
    assert timed(samples).relative_spread > 1.0


@pytest.mark.gpu
def test_one_plan_measured_30_times_is_stable_and_outlier_proof() -> None:
    """One plan, 30 repetitions with L2 flushes: the interquartile range is under 2%;
    a 10x outlier among the real samples moves the median by under 1%."""
    timing = PyCudaBackend(cache_dir=CACHE_DIR, repetitions=REPETITIONS, warmup=5, seed=1)
    try:
        profile = timing.device_profile()
    except BackendError as error:
        pytest.skip(f"no GPU to run on: {error}")
    try:
        problem = Problem(4096, 128, batch=4, heads=16)
        params = KernelParams(
            "tiled", threads=256, tile_size=64, rows_per_block=64, split_target=2**16
        )
        plan = plan_kernel(problem, params, profile)
        result = timing.measure(plan, problem)
        assert result.ok, f"{result.failure}: {result.detail}"
        assert result.repetitions == REPETITIONS and len(result.samples_ms) == REPETITIONS
        assert result.spread_ms is not None and result.median_ms is not None
        assert result.spread_ms / result.median_ms < 0.02, result.samples_ms
        assert 0.1 < (result.tflops or 0) < profile.peak_fp32_tflops
        assert summarize(result.samples_ms).median_ms == result.median_ms
        for at in (0, REPETITIONS // 2, REPETITIONS - 1):
            planted = summarize(with_outlier(result.samples_ms, at))
            moved = abs(planted.median_ms - result.median_ms) / result.median_ms
            assert moved < 0.01, (at, result.samples_ms)
    finally:
        timing.close()
