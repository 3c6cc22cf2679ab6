"""Backends for tests: a cost-model backend that misbehaves on chosen candidates.

A module of its own (not a test file) so that spawned worker processes can
import it by name; pytest puts ``tests/`` on ``sys.path`` and ``spawn`` passes
``sys.path`` on to its children.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kernels.backends.base import Backend, Failure, Measurement
from kernels.backends.model import ModelBackend
from tuner.device import H200, DeviceProfile
from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

#: what a faulty backend does for a plan key, by name
FAULTS = ("exit", "segfault", "hang", "context_lost", "raise", "wrong_answer", "compile")


class FaultyBackend(Backend):
    """The cost model, except for the plan keys in ``faults``.

    ``exit``: ``os._exit(3)``; ``segfault``: SIGSEGV to itself; ``hang``: sleeps
    forever; ``context_lost``: a RUNTIME_DEVICE failure, and every later
    measurement raises (as PyCUDA does once its context is gone); ``raise``:
    ``measure`` raises; ``wrong_answer``/``compile``: those failures.
    """

    name = "faulty"

    def __init__(
        self, faults: Mapping[str, str], device: DeviceProfile = H200, prepare_s: float = 0.0
    ) -> None:
        self.faults = dict(faults)
        self.model = ModelBackend(device)
        self.context_lost = False
        self.pid = os.getpid()
        #: ``prepare`` takes this long (a large problem's inputs); negative: it raises
        self.prepare_s = prepare_s
        self.prepared: list[str] = []

    def prepare(self, problem: Problem) -> None:
        if self.prepare_s < 0:
            raise MemoryError(f"{problem.label()} does not fit")
        time.sleep(self.prepare_s)
        self.prepared.append(problem.label())

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        if self.context_lost:
            raise RuntimeError("the CUDA context was lost earlier")
        fault = self.faults.get(plan.key())
        if fault == "exit":
            os._exit(3)
        if fault == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(60)  # the signal is delivered before this returns
        if fault == "hang":
            while True:
                time.sleep(3600)
        if fault == "context_lost":
            self.context_lost = True
            return Measurement.failed(Failure.RUNTIME_DEVICE, "an illegal memory access")
        if fault == "raise":
            raise ValueError(f"no good: {plan.key()}")
        if fault == "wrong_answer":
            return Measurement.failed(Failure.WRONG_ANSWER, "max |err| 0.5 > 0.001")
        if fault == "compile":
            return Measurement.failed(Failure.COMPILE, "error: expected a ';'", measured=False)
        measurement = self.model.measure(plan, problem)
        # Pretend to be a GPU, with this process's id, so tests can tell workers apart.
        return Measurement(
            measured=True,
            median_ms=measurement.median_ms,
            spread_ms=0.0,
            tflops=measurement.tflops,
            gbps=measurement.gbps,
            max_abs_error=0.0,
            detail=f"pid {os.getpid()}" + "".join(f", prepared {p}" for p in self.prepared),
        )

    def environment(self) -> dict[str, str | int]:
        return {"gpu_name": "faulty test GPU", "compute_capability": "9.0", "sm_count": 132}

    def device_profile(self) -> DeviceProfile:
        return self.model.device


@dataclass(frozen=True)
class FaultyFactory:
    """Picklable: builds a ``FaultyBackend`` inside the worker process."""

    faults: Mapping[str, str] = field(default_factory=dict)
    fail_to_start: bool = False
    name: str = "faulty"
    prepare_s: float = 0.0

    def __call__(self) -> Backend:
        if self.fail_to_start:
            raise RuntimeError("no device here")
        return FaultyBackend(self.faults, prepare_s=self.prepare_s)


class RecordingBackend(Backend):
    """In-process: the cost model's answers, and a list of every plan it was asked about."""

    name = "recording"

    def __init__(self, device: DeviceProfile = H200, measured: bool = True) -> None:
        self.model = ModelBackend(device)
        self.measured = measured
        self.seen: list[KernelPlan] = []

    def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
        assert plan.feasible, f"an infeasible plan reached the backend: {plan.key()}"
        self.seen.append(plan)
        measurement = self.model.measure(plan, problem)
        return Measurement(
            measured=self.measured,
            median_ms=measurement.median_ms,
            spread_ms=0.0,
            tflops=measurement.tflops,
            gbps=measurement.gbps,
            max_abs_error=0.0,
        )

    def environment(self) -> dict[str, str | int]:
        return {"gpu_name": "recording test GPU", "compute_capability": "9.0", "sm_count": 132}

    @property
    def keys(self) -> list[str]:
        return [plan.key() for plan in self.seen]


def live_children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid``, read from /proc (no psutil).

    Leaves out multiprocessing's resource tracker: one helper per process that
    ``spawn`` starts once and that exits with its parent; it measures nothing.
    """
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, parent = fields[0], int(fields[1])
        if parent == pid and state != "Z" and not _is_resource_tracker(entry):
            children.append(int(entry))
    return children


def _is_resource_tracker(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"multiprocessing.resource_tracker" in cmdline.read()
    except OSError:
        return False
