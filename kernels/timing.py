"""How a launch is timed: warm-up, an L2 flush before each repetition, median and IQR.

The loop is independent of the CUDA binding (PyCUDA in the backend, torch in
``bench/speed_check.py``), so the project's kernels and the peer are timed
the same way. The timer is a pair of CUDA events recorded around the launches
only; the flush is enqueued before the start event, so it is outside the timed
region yet ordered before it on the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem


class EventTimer(Protocol):
    def start(self) -> None:
        """Record the start event on the launch stream."""

    def stop(self) -> float:
        """Record the end event, wait for it, and return the elapsed milliseconds."""


@dataclass(frozen=True, slots=True)
class TimingStats:
    median_ms: float
    #: interquartile range (75th - 25th percentile) of the samples
    spread_ms: float
    samples_ms: tuple[float, ...]

    @property
    def relative_spread(self) -> float:
        return self.spread_ms / self.median_ms if self.median_ms > 0 else float("inf")


def summarize(samples_ms: Sequence[float]) -> TimingStats:
    if not samples_ms:
        raise ValueError("no timing samples")
    values = np.asarray(samples_ms, dtype=np.float64)
    q25, median, q75 = np.percentile(values, [25, 50, 75])
    return TimingStats(float(median), float(q75 - q25), tuple(float(x) for x in values))


def time_repetitions(
    run: Callable[[], None],
    timer: EventTimer,
    *,
    repetitions: int,
    warmup: int,
    flush: Callable[[], None] | None = None,
) -> TimingStats:
    """Time ``run`` ``repetitions`` times after ``warmup`` untimed runs.

    Warm-up runs also flush, so the first timed run sees the same cold L2 as the rest.
    """
    if repetitions < 1:
        raise ValueError(f"repetitions={repetitions} must be >= 1")
    for _ in range(max(warmup, 0)):
        if flush is not None:
            flush()
        run()
    samples: list[float] = []
    for _ in range(repetitions):
        if flush is not None:
            flush()
        timer.start()
        run()
        samples.append(timer.stop())
    return summarize(samples)


def throughput(problem: Problem, plan: KernelPlan | None, median_ms: float) -> tuple[float, float]:
    """(TFLOP/s of the attention's useful flops, GB/s of the plan's predicted traffic).

    GB/s is 0 without a plan (e.g. for a peer library whose traffic is unknown).
    """
    seconds = median_ms * 1e-3
    if seconds <= 0:
        return 0.0, 0.0
    tflops = problem.useful_flops / seconds / 1e12
    gbps = plan.global_bytes / seconds / 1e9 if plan is not None else 0.0
    return tflops, gbps
