"""Deliberately broken kernels on a real GPU, through the real isolation layer and search.

The measuring worker is the product's ``IsolatedBackend`` running
``tests/fault_backend.py``'s ``FaultInjectingBackend``: the real ``PyCudaBackend``,
which for chosen plan keys compiles a broken kernel from ``tests/broken_kernels/``
in place of ``kernels/tiled.cu`` (an out-of-bounds store, an endless loop, a compile
error, a forgotten softmax scale, one NaN) or launches the real kernel with a block
of 2048 threads or more dynamic shared memory than the device's opt-in limit. Each
must end its measurement with its reason, the worker is replaced only where the
CUDA context cannot be trusted, the next candidate measures normally, no failed
plan reaches the registry, and no process of ours is left on the GPU.

Which plan gets which fault, and the study's trial order, are named in
``tests/fault_plans.py``, not taken from the cost model's ranking: a refit of the model
cannot move a fault onto a plan it was never checked on. ``tests/test_reliability_faults.py``
compiles every broken source with those plans' defines on the CPU.

Skipped where pycuda is missing or no CUDA device answers. About a minute on an
H200: one worker start per lost context (~2 s each), two 10 s hangs, and on a cold
cubin cache the variants of the 1x2x256x64 space compiled in parallel first.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_backend import (
    EXPECTED,
    LAUNCH_FAULTS,
    REPLACES_WORKER,
    SOURCE_FAULTS,
    FaultInjectingFactory,
    compile_broken,
)
from fault_plans import (
    FAULT_PLANS,
    GOOD_PLAN,
    PROBLEM,
    STUDY_FAULTS,
    by_key,
    place_faults,
    study_schedule,
)
from faulty_backend import live_children_of

from db import PlanRegistry
from kernels import build
from kernels.backends import detect_cuda
from kernels.backends.base import Failure
from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR, launch_refused
from tuner.app import _store_best
from tuner.config import SearchConfig
from tuner.costmodel import Prediction, predict
from tuner.device import H200, DeviceProfile
from tuner.environment import Environment
from tuner.isolation import KILL_GRACE_S, IsolatedBackend
from tuner.planner import candidate_space
from tuner.planner.seed import FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
from tuner.planner.tunable import KernelPlan
from tuner.precompile import precompile
from tuner.search import run_search
from tuner.study_space import StudySpace

pytestmark = pytest.mark.gpu

CACHE_DIR = os.environ.get("FLASH_ATTENTION_TUNER_CUBIN_CACHE", DEFAULT_CACHE_DIR)
TRIAL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Gpu:
    profile: DeviceProfile
    environment: Environment
    #: the plans of PROBLEM the compiler accepts on this GPU, as a tune run keeps them
    clean: list[KernelPlan]
    fault_cache_dir: Path

    def factory(self, faults: dict[str, str]) -> FaultInjectingFactory:
        return FaultInjectingFactory(
            str(self.fault_cache_dir), faults, cache_dir=CACHE_DIR, repetitions=5, warmup=1
        )

    def plans(self, *keys: str) -> list[KernelPlan]:
        return by_key(self.clean, keys)

    def compile_faults(self, faults: dict[str, str], plans: list[KernelPlan]) -> None:
        """The broken cubins built here, so the worker's measurement only loads them."""
        for plan in plans:
            fault = faults.get(plan.key())
            if fault not in SOURCE_FAULTS:
                continue
            result = compile_broken(plan, fault, self.fault_cache_dir, self.profile.arch)
            if fault == "compile_error":
                assert isinstance(result, build.CompileFailure)
            else:
                assert isinstance(result, build.CompiledKernel), result
                judged = plan.with_resources(result.primary_resources, self.profile)
                assert judged.feasible, f"{plan.key()} {fault}: {judged.reason}"


@pytest.fixture(scope="module")
def gpu(tmp_path_factory: pytest.TempPathFactory) -> Gpu:
    if importlib.util.find_spec("pycuda") is None:
        pytest.skip("pycuda is not installed")
    missing = detect_cuda()  # in a subprocess: this process never touches CUDA
    if missing is not None:
        pytest.skip(f"no CUDA device answers: {missing}")
    fault_cache = tmp_path_factory.mktemp("broken-cubins")
    probe = IsolatedBackend(FaultInjectingFactory(str(fault_cache)), 60.0)
    try:
        profile = probe.device_profile()
        environment = Environment(**probe.environment())  # type: ignore[arg-type]
    finally:
        probe.close()
    assert profile is not None
    # As a tune run does: compile the space first and keep what the compiler accepts.
    clean, _ = precompile(candidate_space(PROBLEM, profile).feasible, profile, CACHE_DIR)
    # The schedule the CPU test compiled the broken sources for (on the configured H200
    # profile) is the one this GPU gets: its limits accept the same plans.
    configured, _ = precompile(candidate_space(PROBLEM, H200).feasible, H200, CACHE_DIR)
    schedule = [p.key() for p in study_schedule(clean)]
    assert schedule == [p.key() for p in study_schedule(configured)]
    return Gpu(profile, environment, clean, fault_cache)


def scheduled(order: list[KernelPlan], profile: DeviceProfile) -> dict[str, Prediction]:
    """Predictions that put ``order`` first to last: the search enqueues by predicted time,
    so the study meets the plans in the test's own schedule whatever the cost model ranks."""
    return {
        plan.key(): dataclasses.replace(predict(plan, profile), time_ms=float(position + 1))
        for position, plan in enumerate(order)
    }


@pytest.fixture
def our_processes() -> Iterator[set[int]]:
    """Collects the worker pids a test saw; afterwards none is alive or on the GPU."""
    before = set(live_children_of(os.getpid()))
    before_mp = set(multiprocessing.active_children())
    pids: set[int] = set()
    yield pids
    assert pids, "the test saw no worker"
    assert set(multiprocessing.active_children()) - before_mp == set()
    assert set(live_children_of(os.getpid())) - before == set()
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert_off_the_gpu(pids)


def gpu_process_ids() -> set[int] | None:
    """pids holding a context on any GPU, per nvidia-smi; None where it cannot tell."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        listed = subprocess.run(
            [smi, "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {int(word) for word in listed.stdout.split() if word.isdigit()}


def assert_off_the_gpu(pids: set[int], within_s: float = 15.0) -> None:
    """None of ``pids`` is among the GPU's compute processes (the driver may take a moment
    to tear a killed process's context down). In a container nvidia-smi may list host
    pids, which never match ours: the check then passes without saying much."""
    deadline = time.monotonic() + within_s
    while True:
        listed = gpu_process_ids()
        left = set() if listed is None else listed & pids
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"worker processes still hold the GPU: {sorted(left)}"


def detail_says(fault: str, detail: str) -> bool:
    if fault == "illegal_address":
        return "illegal memory access" in detail or "illegal address" in detail
    if fault == "hang":
        return f"gave no result within {TRIAL_TIMEOUT_S:g} s; worker stopped" in detail
    if fault == "compile_error":
        return 'identifier "undeclared_value" is undefined' in detail
    if fault in LAUNCH_FAULTS:
        return detail.startswith("tiled_attention: ") and launch_refused(detail)
    if fault == "wrong_answer":
        return detail.startswith("max |error| ") and "float64 reference" in detail
    if fault == "nan":
        # Exactly the one planted element: the kernel wrote every other one.
        return detail.startswith("1 non-finite elements") and "first at (0, 128, 0)" in detail
    raise AssertionError(fault)


def assert_measured_normally(result, what: str) -> None:
    assert result.ok and result.measured, f"{what}: {result.failure} {result.detail}"
    assert result.max_abs_error is not None
    assert result.max_abs_error <= FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
    assert result.repetitions == 5 and result.median_ms > 0


def test_each_broken_kernel_ends_its_measurement_with_its_reason(
    gpu: Gpu, our_processes: set[int]
) -> None:
    assert set(FAULT_PLANS) == set(EXPECTED)
    broken = gpu.plans(*FAULT_PLANS.values())
    faults = {key: fault for fault, key in FAULT_PLANS.items()}
    gpu.compile_faults(faults, broken)
    (good,) = gpu.plans(GOOD_PLAN)
    backend = IsolatedBackend(gpu.factory(faults), TRIAL_TIMEOUT_S)
    try:
        assert_measured_normally(backend.measure(good, PROBLEM), "before any fault")
        for plan in broken:
            fault = faults[plan.key()]
            worker = backend.pid
            assert worker is not None
            our_processes.add(worker)
            started = time.monotonic()
            result = backend.measure(plan, PROBLEM)
            took = time.monotonic() - started
            what = f"{fault} on {plan.key()}"
            if EXPECTED[fault] is None:  # the control: the injection path itself is sound
                assert_measured_normally(result, what)
            else:
                assert result.failure == EXPECTED[fault], f"{what}: {result}"
                assert detail_says(fault, result.detail), f"{what}: {result.detail}"
            if fault == "hang":
                assert TRIAL_TIMEOUT_S <= took < TRIAL_TIMEOUT_S + 3 * KILL_GRACE_S
            else:
                assert took < TRIAL_TIMEOUT_S, what
            # The worker goes exactly when its CUDA context can no longer be trusted.
            assert (backend.pid is None) == (fault in REPLACES_WORKER), what
            assert_measured_normally(backend.measure(good, PROBLEM), f"after {what}")
            assert backend.pid is not None
            our_processes.add(backend.pid)
        assert backend.starts == 1 + len(REPLACES_WORKER)
    finally:
        backend.close()


def test_a_study_of_60_with_10_broken_ends_with_50_measured_and_10_failed(
    gpu: Gpu, our_processes: set[int], tmp_path: Path
) -> None:
    order = study_schedule(gpu.clean)
    candidates = list(order)
    faults = place_faults(order, STUDY_FAULTS)
    gpu.compile_faults(faults, candidates)
    predictions = scheduled(order, gpu.profile)
    backend = IsolatedBackend(gpu.factory(faults), TRIAL_TIMEOUT_S)
    settings = SearchConfig(
        sampler="tpe",  # its queue of all 60, in the schedule's order, is the fault schedule
        n_trials=60,
        enqueue_top=60,
        traffic_cutoff=1e9,
        trial_timeout_s=TRIAL_TIMEOUT_S,
        seed=0,
    )
    backend.start()
    assert backend.pid is not None
    our_processes.add(backend.pid)

    def note_worker(_outcome: object) -> None:
        if backend.pid is not None:
            our_processes.add(backend.pid)

    try:
        result = run_search(
            StudySpace(PROBLEM, gpu.profile, candidates, []),
            backend,
            settings,
            storage=f"sqlite:///{tmp_path / 'study.sqlite'}",
            study_name="gpu-faults",
            predictions=predictions,
            progress=note_worker,
        )
    finally:
        backend.close()

    trials = result.trials
    assert [t.key for t in trials] == [p.key() for p in order]  # all 60, enqueued in order
    assert result.counted == 60 and not result.interrupted
    measured = [t for t in trials if t.state == "COMPLETE" and t.outcome == "measured"]
    failed = [t for t in trials if t.state == "PRUNED" and t.outcome == "failed"]
    assert len(measured) == 50 and len(failed) == 10
    assert all(t.measured and t.median_ms for t in measured)
    assert {t.key for t in failed} == set(faults)
    for trial in failed:
        fault = faults[trial.key]
        assert trial.failure == str(EXPECTED[fault]), f"{fault}: {trial.failure} {trial.detail}"
        assert detail_says(fault, trial.detail), f"{fault}: {trial.detail}"
    assert collections.Counter(t.failure for t in failed) == {
        Failure.RUNTIME_DEVICE: 2,
        Failure.TIMEOUT: 1,
        Failure.COMPILE: 2,
        Failure.RESOURCES: 2,
        Failure.WRONG_ANSWER: 3,
    }
    # The study went on: the trial after every fault measured normally.
    for index, trial in enumerate(trials):
        if trial.key in faults:
            following = trials[index + 1]
            assert following.state == "COMPLETE" and following.measured, following
            assert following.max_abs_error is not None
            assert following.max_abs_error <= FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
    # A fresh worker for each lost context (two illegal addresses, one hang).
    assert backend.starts == 1 + 3

    best = result.best
    assert best is not None and best.key not in faults and best.measured
    url = f"sqlite:///{tmp_path / 'registry.sqlite'}"
    hashes = {family: build.source_hash(family) for family in build.SOURCES}
    line = _store_best(result, PROBLEM, gpu.environment, hashes, url)
    assert line.startswith(f"registry: {best.key} ")
    with PlanRegistry.open(url, readonly=True) as registry:
        history = registry.history(limit=None)
        served = registry.best(PROBLEM, gpu.environment, source_hashes=hashes)
    assert len(history) == 1 and served is not None and served.served_as_measured
    stored = history[0].record
    assert (stored.study_name, stored.trial_number) == ("gpu-faults", best.number)
    by_number = {t.number: t for t in trials}
    assert by_number[stored.trial_number].key not in faults
    assert by_number[stored.trial_number].state == "COMPLETE"
    with sqlite3.connect(tmp_path / "registry.sqlite") as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
