"""Isolated measurements: crashes, hangs and lost contexts become failure values.

The worker runs ``tests/faulty_backend.py`` (the cost model, misbehaving on
chosen plan keys) in a spawned process; no GPU is needed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
from faulty_backend import FaultyFactory, live_children_of

from kernels.backends import BackendFactory
from kernels.backends.base import Failure
from tuner.config import BackendConfig, SearchConfig
from tuner.costmodel import predict
from tuner.device import H200
from tuner.errors import BackendError
from tuner.isolation import IsolatedBackend
from tuner.planner import KernelParams, candidate_space, plan_kernel
from tuner.problem import Problem
from tuner.search import run_search
from tuner.study_space import StudySpace

PROBLEM = Problem(512, 64)


def plan(tile: int = 32, rows: int = 32, threads: int = 128, split: int = 4):
    result = plan_kernel(PROBLEM, KernelParams("tiled", threads, tile, rows, split), H200)
    assert result.feasible, result.reason
    return result


GOOD, BAD = plan(), plan(tile=16)


def no_children_left() -> None:
    # The worker is reaped by the time close() returns: nothing alive, no zombie.
    assert multiprocessing.active_children() == []
    assert live_children_of(os.getpid()) == []


@pytest.fixture
def isolated():
    backends: list[IsolatedBackend] = []

    def make(faults: dict[str, str] | None = None, timeout_s: float = 30.0) -> IsolatedBackend:
        backend = IsolatedBackend(FaultyFactory(faults or {}), timeout_s)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.close()
    no_children_left()


def test_measures_in_another_process_and_keeps_the_worker(isolated):
    backend = isolated()
    first = backend.measure(GOOD, PROBLEM)
    second = backend.measure(BAD, PROBLEM)
    assert first.ok and second.ok and first.measured
    worker = first.detail
    assert worker != f"pid {os.getpid()}"
    assert second.detail == worker and backend.starts == 1
    assert backend.environment()["gpu_name"] == "faulty test GPU"
    assert backend.device_profile() == H200


def test_prepare_returns_at_once_and_the_worker_prepares_before_it_measures():
    backend = IsolatedBackend(FaultyFactory(prepare_s=1.0), 30.0)
    try:
        backend.start()
        began = time.monotonic()
        backend.prepare(PROBLEM)
        assert time.monotonic() - began < 0.5  # not waiting for the worker
        measurement = backend.measure(GOOD, PROBLEM)
        assert measurement.ok and f"prepared {PROBLEM.label()}" in measurement.detail
        assert time.monotonic() - began >= 1.0  # the measurement came after it
    finally:
        backend.close()
    no_children_left()


def test_a_prepare_that_fails_leaves_the_worker_measuring():
    backend = IsolatedBackend(FaultyFactory(prepare_s=-1.0), 30.0)
    try:
        backend.prepare(PROBLEM)
        measurement = backend.measure(GOOD, PROBLEM)
        assert measurement.ok and "prepared" not in measurement.detail
        assert backend.starts == 1
    finally:
        backend.close()
    no_children_left()


@pytest.mark.parametrize(
    ("fault", "failure", "words"),
    [
        ("exit", Failure.WORKER_CRASH, "exited with status 3"),
        ("segfault", Failure.WORKER_CRASH, "killed by SIGSEGV"),
        ("raise", Failure.WORKER_CRASH, "ValueError: no good"),
        ("context_lost", Failure.RUNTIME_DEVICE, "illegal memory access"),
    ],
)
def test_a_fatal_candidate_fails_and_the_worker_is_replaced(isolated, fault, failure, words):
    backend = isolated({BAD.key(): fault})
    before = backend.measure(GOOD, PROBLEM)
    result = backend.measure(BAD, PROBLEM)
    assert result.failure == failure
    assert words in result.detail
    after = backend.measure(GOOD, PROBLEM)
    assert after.ok, after.detail
    assert after.detail != before.detail  # another process
    assert backend.starts == 2


def test_a_hang_times_out_and_the_worker_is_killed(isolated):
    backend = isolated({BAD.key(): "hang"}, timeout_s=1.0)
    backend.measure(GOOD, PROBLEM)
    hung_pid = backend.pid
    started = time.monotonic()
    result = backend.measure(BAD, PROBLEM)
    assert result.failure == Failure.TIMEOUT
    assert "within 1 s" in result.detail
    assert time.monotonic() - started < 10
    assert hung_pid not in live_children_of(os.getpid())
    assert backend.measure(GOOD, PROBLEM).ok


@pytest.mark.parametrize("fault", ["wrong_answer", "compile"])
def test_a_harmless_failure_keeps_the_worker(isolated, fault):
    backend = isolated({BAD.key(): fault})
    backend.measure(BAD, PROBLEM)
    pid = backend.pid
    assert backend.measure(GOOD, PROBLEM).ok
    assert backend.pid == pid and backend.starts == 1


def test_a_worker_that_cannot_start_is_a_run_level_error():
    backend = IsolatedBackend(FaultyFactory(fail_to_start=True), 10.0)
    with pytest.raises(BackendError, match="cannot start: RuntimeError: no device here"):
        backend.measure(GOOD, PROBLEM)
    backend.close()
    no_children_left()


def test_ctrl_c_while_measuring_stops_the_worker(isolated):
    backend = isolated({BAD.key(): "hang"}, timeout_s=60.0)
    backend.measure(GOOD, PROBLEM)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        backend.measure(BAD, PROBLEM)
    timer.join()
    assert backend.pid is None
    no_children_left()


def test_the_model_backend_runs_isolated_from_its_picklable_factory(isolated):
    backend = IsolatedBackend(BackendFactory("model", BackendConfig()), 30.0)
    try:
        result = backend.measure(GOOD, PROBLEM)
        assert not result.measured and result.ok
        assert backend.environment()["gpu_name"] == "model"
    finally:
        backend.close()


def test_a_study_goes_on_past_crashes_and_hangs(tmp_path):
    """The whole search over an isolated faulty backend: every trial ends with a verdict."""
    space = candidate_space(PROBLEM, H200)
    predictions = {p.key(): predict(p, H200) for p in space.feasible}
    ranked = sorted(space.feasible, key=lambda p: predictions[p.key()].time_ms)
    faults = {
        ranked[1].key(): "exit",
        ranked[2].key(): "segfault",
        ranked[3].key(): "hang",
        ranked[4].key(): "context_lost",
    }
    backend = IsolatedBackend(FaultyFactory(faults), timeout_s=1.5)
    settings = SearchConfig(n_trials=8, enqueue_top=8, sampler="tpe", traffic_cutoff=1e9)
    try:
        result = run_search(
            StudySpace(PROBLEM, H200, space.feasible, space.rejected),
            backend,
            settings,
            storage=f"sqlite:///{tmp_path / 'studies.sqlite'}",
            study_name="faults",
            predictions=predictions,
        )
    finally:
        backend.close()
    no_children_left()
    by_key = {t.key: t for t in result.trials}
    assert [t.key for t in result.trials[:8]] == [p.key() for p in ranked[:8]]
    assert by_key[ranked[1].key()].failure == "WORKER_CRASH"
    assert by_key[ranked[2].key()].failure == "WORKER_CRASH"
    assert "SIGSEGV" in by_key[ranked[2].key()].detail
    assert by_key[ranked[3].key()].failure == "TIMEOUT"
    assert by_key[ranked[4].key()].failure == "RUNTIME_DEVICE"
    for key in faults:
        assert by_key[key].state == "PRUNED" and by_key[key].outcome == "failed"
    others = [t for t in result.trials if t.key not in faults]
    assert others and all(t.state == "COMPLETE" and t.measured for t in others)
    assert result.counted == 8 and not result.interrupted
    assert backend.starts == 5  # the first worker and one per fatal fault
