"""Backends for worker-process tests, and helpers to read what the workers left behind.

A module of its own (not a test file) so that spawned worker processes can
import it by name; pytest puts ``tests/`` on ``sys.path`` and ``spawn`` passes
``sys.path`` on to its children.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import optuna

from kernels.backends.base import Backend, Measurement
from kernels.backends.model import ModelBackend
from tuner.config import SearchConfig
from tuner.costmodel import predict
from tuner.device import H200
from tuner.planner import SpaceAxes, candidate_space
from tuner.problem import Problem
from tuner.study_space import StudySpace
from tuner.trials import COUNTED_OUTCOMES

ENVIRONMENT = {"gpu_name": "slow test GPU", "compute_capability": "9.0", "sm_count": 132}


class SlowBackend(Backend):
    """The cost model's answer after ``seconds``, as if measured on a GPU.

    Appends ``start <pid> <key>`` and ``end <pid> <key>`` lines to ``log``
    around each measurement, and ``built <pid> <CUDA_VISIBLE_DEVICES>`` once.
    """

    name = "slow"

    def __init__(self, seconds: float, log: str) -> None:
        self.seconds, self.log = seconds, log
        self.model = ModelBackend(H200)
        self._note(f"built {os.getpid()} {os.environ.get('CUDA_VISIBLE_DEVICES', '-')}")

    def _note(self, line: str) -> None:
        with open(self.log, "a") as log:
            log.write(line + "\n")
            log.flush()

    def measure(self, plan, problem: Problem) -> Measurement:  # type: ignore[no-untyped-def]
        self._note(f"start {os.getpid()} {plan.key()}")
        time.sleep(self.seconds)
        predicted = self.model.measure(plan, problem)
        self._note(f"end {os.getpid()} {plan.key()}")
        return Measurement(
            measured=True,
            median_ms=predicted.median_ms,
            spread_ms=0.0,
            tflops=predicted.tflops,
            gbps=predicted.gbps,
            max_abs_error=0.0,
            detail=f"pid {os.getpid()}",
        )

    def environment(self) -> dict[str, str | int]:
        return dict(ENVIRONMENT)


@dataclass(frozen=True)
class SlowFactory:
    """Picklable: builds a ``SlowBackend`` inside each worker process."""

    seconds: float
    log: str
    name: str = "slow"

    def __call__(self) -> Backend:
        return SlowBackend(self.seconds, self.log)


def make_space(problem: Problem | None = None) -> tuple[StudySpace, dict]:
    problem = problem or Problem(512, 64)
    planned = candidate_space(problem, H200, SpaceAxes())
    predictions = {p.key(): predict(p, H200) for p in planned.feasible}
    return StudySpace(problem, H200, planned.feasible, planned.rejected), predictions


def settings(**values: object) -> SearchConfig:
    values.setdefault("traffic_cutoff", 1e9)
    # make_space builds TPE's structured space (the model sampler takes a candidate one)
    values.setdefault("sampler", "tpe")
    return SearchConfig(**values)  # type: ignore[arg-type]


def log_lines(log: str | Path, kind: str) -> list[list[str]]:
    path = Path(log)
    if not path.exists():
        return []
    return [line.split()[1:] for line in path.read_text().splitlines() if line.startswith(kind)]


def only_study(storage: str) -> list[optuna.trial.FrozenTrial]:
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


def assert_exact(trials: list[optuna.trial.FrozenTrial], n_trials: int) -> list[str]:
    """Exactly ``n_trials`` count, no plan among them twice, no trial number twice."""
    counted = [t for t in trials if t.user_attrs.get("outcome") in COUNTED_OUTCOMES]
    keys = [str(t.user_attrs["plan_key"]) for t in counted]
    assert len(counted) == n_trials, Counter(str(t.user_attrs.get("outcome")) for t in trials)
    assert len(set(keys)) == len(keys), [k for k, c in Counter(keys).items() if c > 1]
    numbers = [t.number for t in trials]
    assert len(set(numbers)) == len(numbers)
    return keys
