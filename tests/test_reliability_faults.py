"""The CPU half of the GPU fault tests (tests/test_gpu_faults.py): the broken kernels and
the backend that plants them, checked where no GPU is needed.

* Every file of ``tests/broken_kernels/`` goes through the product's build with nvcc
  here, as the GPU test's worker will compile it: the compile error fails with its
  one-line reason, the others compile to cubins with both entry points, no spills,
  and a resource verdict that keeps the plan feasible, so each fault reaches the
  launch it is meant to break. This is done for every plan the GPU tests plant a
  source fault in (``tests/fault_plans.py`` names them), and each stand-in declares
  the real kernel's parameters, type for type.
* The launch faults change exactly the first launch.
* The backend refuses faults it cannot plant, puts the build's source and its own
  cache back after a measurement that failed halfway, and its factory builds it in a
  spawned worker of the real isolation layer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from fault_backend import (
    BROKEN_DIR,
    EXPECTED,
    LAUNCH_FAULTS,
    SOURCE_FAULTS,
    TOO_MANY_THREADS,
    FaultInjectingBackend,
    FaultInjectingFactory,
    break_launches,
    broken_source,
    check_fault,
    compile_broken,
)
from fault_plans import (
    FAULT_PLANS,
    GOOD_PLAN,
    STUDY_FAULTS,
    by_key,
    place_faults,
    study_schedule,
)
from kernel_signatures import signatures_in, with_local_includes

from kernels import build
from kernels.launch import DeviceBuffers, launch_sequence
from tuner.device import H200
from tuner.errors import BackendError
from tuner.isolation import IsolatedBackend
from tuner.planner import KernelParams, candidate_space, plan_kernel
from tuner.planner.plan import allocated_registers
from tuner.planner.tunable import KernelPlan
from tuner.precompile import precompile
from tuner.problem import Problem

PROBLEM = Problem(256, 64, batch=1, heads=2)
#: one split (source faults need it), 512 threads (the tightest register budget)
ONE_SPLIT = plan_kernel(PROBLEM, KernelParams("tiled", 512, 64, 128, 2**16), H200)
SPLIT = plan_kernel(PROBLEM, KernelParams("tiled", 128, 32, 32, 2), H200)
REAL_TILED = build.SOURCES["tiled"]

needs_nvcc = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc is not installed")


def test_the_plans_are_what_the_tests_need() -> None:
    assert ONE_SPLIT.feasible and ONE_SPLIT.sequence_splits == 1
    assert SPLIT.feasible and SPLIT.sequence_splits > 1
    assert set(EXPECTED) == set(SOURCE_FAULTS) | set(LAUNCH_FAULTS)
    assert sorted(p.name for p in BROKEN_DIR.glob("*.cu")) == sorted(SOURCE_FAULTS.values())


@needs_nvcc
def test_each_broken_source_compiles_or_fails_as_intended(tmp_path: Path) -> None:
    for fault in SOURCE_FAULTS:
        # The worker's own step: the product's build under the swap (cached per fault here).
        result = compile_broken(ONE_SPLIT, fault, tmp_path)
        if fault == "compile_error":
            assert isinstance(result, build.CompileFailure)
            assert 'identifier "undeclared_value" is undefined' in result.reason
            assert "\n" not in result.reason
            continue
        assert isinstance(result, build.CompiledKernel), f"{fault}: {result}"
        assert set(result.resources) == set(build.ENTRY_FUNCTIONS["tiled"])
        usage = result.primary_resources
        assert usage.spill_store_bytes == usage.spill_load_bytes == 0, fault
        # The resource verdict keeps the plan feasible: the fault is met at launch or later.
        judged = ONE_SPLIT.with_resources(usage, H200)
        assert judged.feasible, f"{fault}: {judged.reason}"


@needs_nvcc
def test_the_swap_changes_the_source_the_build_sees_and_is_undone(tmp_path: Path) -> None:
    real_hash = build.source_hash("tiled")
    with broken_source("tiled", "nan") as path:
        assert build.source_path("tiled") == path
        assert build.source_hash("tiled") != real_hash
        compiled = build.compile_kernel(ONE_SPLIT, tmp_path)
    assert isinstance(compiled, build.CompiledKernel)
    assert compiled.source_hash != real_hash and not compiled.cache_hit
    with broken_source("tiled", "compile_error"):
        failed = build.compile_kernel(ONE_SPLIT, tmp_path)
    assert isinstance(failed, build.CompileFailure)
    # The reason names the broken file without the kernels folder, as for a real failure.
    assert failed.reason.startswith(f"{BROKEN_DIR / 'compile_error.cu'}(4): error: ")
    assert build.SOURCES["tiled"] == REAL_TILED and build.source_hash("tiled") == real_hash


def test_each_stand_in_declares_the_real_kernels_parameters() -> None:
    """A stand-in with fewer parameters than the launch packs is refused by the driver with
    "too many resources requested for launch", whatever its fault (the fixture fell two
    parameters behind ``kernels/tiled.cu`` when the kernel took ``kv_len`` and ``kv_group``)."""
    real = signatures_in(with_local_includes(build.source_path("tiled")))
    assert set(real) == set(build.ENTRY_FUNCTIONS["tiled"])
    for fault, name in SOURCE_FAULTS.items():
        if fault == "compile_error":
            continue  # never launched
        declared = signatures_in(with_local_includes(BROKEN_DIR / name))
        assert declared == real, f"{name}: {declared} != {real}"


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> list[KernelPlan]:
    """The tiled plans of PROBLEM the compiler accepts, as the GPU test's fixture keeps them."""
    if build.find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    tiled = [p for p in candidate_space(PROBLEM, H200).feasible if p.family == "tiled"]
    accepted, _ = precompile(tiled, H200, str(tmp_path_factory.mktemp("cubins")))
    return accepted


def planted_source_faults(clean: list[KernelPlan]) -> list[tuple[str, KernelPlan]]:
    """(fault, plan) of every source fault the two GPU tests plant."""
    study = place_faults(study_schedule(clean), STUDY_FAULTS)
    pairs = [*FAULT_PLANS.items(), *((fault, key) for key, fault in study.items())]
    return [
        (fault, plan)
        for fault, key in pairs
        if fault in SOURCE_FAULTS
        for plan in by_key(clean, [key])
    ]


def test_every_named_plan_is_one_the_compiler_accepts(clean: list[KernelPlan]) -> None:
    by_key(clean, [GOOD_PLAN, *FAULT_PLANS.values()])  # KeyError naming any that is not
    assert set(FAULT_PLANS) == set(EXPECTED)
    for fault, (plan,) in ((f, by_key(clean, [k])) for f, k in FAULT_PLANS.items()):
        assert fault in LAUNCH_FAULTS or plan.sequence_splits == 1, fault
    assert by_key(clean, [GOOD_PLAN])[0].sequence_splits > 1


def test_every_planted_source_compiles_and_fits_the_block_s_register_file(
    clean: list[KernelPlan], tmp_path: Path
) -> None:
    planted = planted_source_faults(clean)
    assert {fault for fault, _ in planted} == set(SOURCE_FAULTS)
    assert len(planted) >= 12
    for fault, plan in planted:
        what = f"{fault} in {plan.key()}"
        result = compile_broken(plan, fault, tmp_path)
        if fault == "compile_error":
            assert isinstance(result, build.CompileFailure), what
            continue
        assert isinstance(result, build.CompiledKernel), f"{what}: {result}"
        usage = result.primary_resources
        assert usage.spill_store_bytes == usage.spill_load_bytes == 0, what
        registers = allocated_registers(usage.registers, H200) * plan.threads
        assert registers <= H200.registers_per_block == 65536, f"{what}: {registers}"
        assert plan.with_resources(usage, H200).feasible, what


def test_the_study_schedule_is_the_test_s_own(clean: list[KernelPlan]) -> None:
    """The same plans in any order give the same schedule (nothing ranks them); the faults
    are never first or last, never adjacent, and source faults sit on one-split plans."""
    order = study_schedule(clean)
    assert [p.key() for p in study_schedule(list(reversed(clean)))] == [p.key() for p in order]
    assert len(order) == 60 and len({p.key() for p in order}) == 60
    assert [p.sequence_splits == 1 for p in order] == [True, False] * 30
    faults = place_faults(order, STUDY_FAULTS)
    positions = sorted(i for i, p in enumerate(order) if p.key() in faults)
    assert sorted(faults.values()) == sorted(STUDY_FAULTS)
    assert positions[0] > 0 and positions[-1] < len(order) - 1
    assert all(b - a > 1 for a, b in zip(positions, positions[1:], strict=False))
    for position in positions:
        plan = order[position]
        assert faults[plan.key()] in LAUNCH_FAULTS or plan.sequence_splits == 1


def test_the_swap_is_undone_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError), broken_source("tiled", "hang"):
        raise RuntimeError("boom")
    assert build.SOURCES["tiled"] == REAL_TILED


def test_launch_faults_break_only_the_first_launch() -> None:
    buffers = DeviceBuffers(1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20, 6 << 20)
    launches = launch_sequence(SPLIT, buffers)
    assert len(launches) == 2
    threads = break_launches(launches, "too_many_threads", 232448)
    assert threads[0].block == (TOO_MANY_THREADS, 1, 1)
    assert threads[0].block[0] > H200.max_threads_per_block
    assert threads[1] == launches[1]
    assert threads[0].args == launches[0].args and threads[0].grid == launches[0].grid
    shared = break_launches(launches, "too_much_shared", 232448)
    assert shared[0].shared_bytes == 232448 + 1024 and shared[0].needs_shared_opt_in
    assert shared[0].block == launches[0].block and shared[1] == launches[1]
    with pytest.raises(ValueError, match="not a launch fault"):
        break_launches(launches, "hang", 232448)


def test_faults_that_cannot_be_planted_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        check_fault(ONE_SPLIT, "gremlins")
    with pytest.raises(ValueError, match="one-split plans only"):
        check_fault(SPLIT, "hang")
    check_fault(SPLIT, "too_many_threads")  # launch faults fit any plan
    with pytest.raises(ValueError, match="unknown faults"):
        FaultInjectingBackend({"x": "gremlins"}, fault_cache_dir="unused")
    backend = FaultInjectingBackend({SPLIT.key(): "hang"}, fault_cache_dir="unused")
    with pytest.raises(ValueError, match="one-split plans only"):
        backend.measure(SPLIT, PROBLEM)


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda installed")
def test_a_half_done_fault_measurement_restores_source_and_cache(tmp_path: Path) -> None:
    """Without pycuda the backend's first CUDA call raises inside the swap; all is put back."""
    backend = FaultInjectingBackend(
        {ONE_SPLIT.key(): "illegal_address"},
        fault_cache_dir=tmp_path / "broken",
        cache_dir=tmp_path / "cubins",
    )
    with pytest.raises(BackendError, match="pycuda is not installed"):
        backend.measure(ONE_SPLIT, PROBLEM)
    assert build.SOURCES["tiled"] == REAL_TILED
    assert backend.cache_dir == tmp_path / "cubins"


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda installed")
def test_the_factory_builds_the_backend_in_a_spawned_worker(tmp_path: Path) -> None:
    """The factory pickles, the worker imports this folder's module and builds the
    backend; here it then reports, as a run-level error, that it cannot reach CUDA."""
    factory = FaultInjectingFactory(
        str(tmp_path / "broken"), {ONE_SPLIT.key(): "hang"}, cache_dir=str(tmp_path)
    )
    backend = IsolatedBackend(factory, timeout_s=10.0)
    assert backend.name == "pycuda-faults"
    try:
        with pytest.raises(BackendError) as caught:
            backend.start()
    finally:
        backend.close()
    assert str(caught.value) == (
        "the pycuda-faults measurement worker cannot start: BackendError: pycuda is not "
        "installed: pip install 'flash-attention-tuner[cuda]'"
    )
