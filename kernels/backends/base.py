"""The one interface every backend implements: ``measure(plan, problem) -> Measurement``.

A candidate that fails (does not compile, crashes, hangs, gives a wrong answer)
is a ``Measurement`` with ``failure`` set, never an exception: the search
records the reason in the trial and goes on. Backends raise
``tuner.errors.BackendError`` only when they cannot work at all.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tuner.planner.tunable import KernelPlan
    from tuner.problem import Problem


class Failure(enum.StrEnum):
    """Why a candidate produced no timing. Stored as the string value."""

    INFEASIBLE = "INFEASIBLE"  # the planner (or the compiler's resource report) rules it out
    COMPILE = "COMPILE"  # nvcc failed
    RESOURCES = "RESOURCES"  # launch refused: too many registers/threads/shared memory
    RUNTIME_DEVICE = "RUNTIME_DEVICE"  # illegal address, misaligned access, context lost
    TIMEOUT = "TIMEOUT"  # the measurement did not finish in its time limit
    WRONG_ANSWER = "WRONG_ANSWER"  # parity check failed (NaN or |err| > tolerance)
    WORKER_CRASH = "WORKER_CRASH"  # the isolated worker process died (signal, os._exit)


@dataclass(frozen=True, slots=True)
class Measurement:
    """What one candidate gave.

    ``measured`` is True only for real GPU timings; the model backend's figures
    are predictions and say so. Times are milliseconds. ``spread_ms`` is the
    interquartile range of the repetitions.
    """

    measured: bool
    median_ms: float | None = None
    spread_ms: float | None = None
    repetitions: int = 0
    max_abs_error: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    failure: Failure | None = None
    detail: str = ""
    samples_ms: tuple[float, ...] = field(default=(), repr=False)
    #: backward trials: the median time of the forward they ran on (the same problem's
    #: forward, with its LSE), so forward + backward can be shown; None otherwise
    forward_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and self.median_ms is not None

    @classmethod
    def failed(cls, failure: Failure, detail: str, *, measured: bool = True) -> Measurement:
        return cls(measured=measured, failure=failure, detail=detail)


class Backend(ABC):
    """Compiles, launches, checks and times candidates (or predicts them)."""

    #: short name used in configs and logs: "pycuda", "model", "replay"
    name: str = ""

    @abstractmethod
    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        """Measure one plan. Never raises for a per-candidate failure."""

    def environment(self) -> dict[str, str | int]:
        """Facts about where measurements come from (GPU name, versions...)."""
        return {}

    def prepare(self, problem: Problem) -> None:  # noqa: B027 - optional hook
        """Get ready to measure plans of ``problem`` (inputs, references) ahead of the
        first ``measure``, which does it otherwise; an error here is ``measure``'s."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds (contexts, worker processes)."""
