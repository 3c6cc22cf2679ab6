"""Real kernels on a real GPU: parity of every family over the shape matrix.

Timing sanity (one plan measured 30 times) is in tests/test_gpu_timing_sanity.py.

Skipped (with the reason) where pycuda is missing or no CUDA device answers.
All variants are compiled up front in parallel into the cubin cache
(``$FLASH_ATTENTION_TUNER_CUBIN_CACHE`` or the backend's default), so a
second run compiles nothing.

Plans the planner rejects only because a tile, row block or thread block is
larger than the sequence needs (every plan at seq_len 1 and 7) are run anyway:
the kernels must be right there too, whatever the planner prefers. Plans whose
ptxas report shows spills are run as well (``judge_resources=False``): spills
cost time, not correctness.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest

from kernels.backends.base import Failure
from kernels.backends.pycuda_backend import (
    DEFAULT_CACHE_DIR,
    SCALAR_REFERENCE_THREADS,
    PyCudaBackend,
)
from kernels.build import CompileFailure
from tuner.errors import BackendError
from tuner.planner.seed import FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
from tuner.planner.tunable import KernelParams, KernelPlan, plan_kernel
from tuner.problem import Problem

pytestmark = pytest.mark.gpu

CACHE_DIR = os.environ.get("FLASH_ATTENTION_TUNER_CUBIN_CACHE", DEFAULT_CACHE_DIR)
SEQ_LENS = (1, 7, 64, 1000, 4096)
HEAD_DIMS = (32, 64, 128)
#: (tile_size, rows_per_block, threads, split_target): many splits, some, none, some with
#: a 128-row block; at seq_len 4096 they launch 256, 32, 1 and 32 splits.
TILED = ((16, 16, 64, 1), (32, 64, 128, 4), (64, 64, 256, 2**16), (64, 128, 256, 2))
SCALAR_THREADS = 64
#: reasons that only say "bigger than this sequence needs"; such plans still must be right
SIZE_ONLY_REASONS = ("larger than needed", "exceeds what seq_len")


def problems() -> list[Problem]:
    return [
        Problem(n, d, batch=2, heads=3, causal=causal)
        for n, d, causal in itertools.product(SEQ_LENS, HEAD_DIMS, (False, True))
    ]


def plans_for(problem: Problem, profile) -> list[KernelPlan]:
    candidates = [plan_kernel(problem, KernelParams("scalar_online", SCALAR_THREADS), profile)]
    for tile, rows, threads, target in TILED:
        params = KernelParams("tiled", threads, tile, rows, target)
        candidates.append(plan_kernel(problem, params, profile))
    plans = []
    for plan in candidates:
        if not plan.feasible:
            assert any(r in plan.reason for r in SIZE_ONLY_REASONS), plan.reason
            plan = dataclasses.replace(plan, feasible=True, reason="")
        plans.append(plan)
    return plans


@pytest.fixture(scope="module")
def backend():
    gpu = PyCudaBackend(cache_dir=CACHE_DIR, repetitions=3, warmup=1, judge_resources=False, seed=7)
    try:
        profile = gpu.device_profile()
    except BackendError as error:
        pytest.skip(f"no GPU to run on: {error}")
    plans = [plan for problem in problems() for plan in plans_for(problem, profile)]
    # and the scalar kernel the backend uses as the GPU reference for large problems
    reference = KernelParams("scalar_online", SCALAR_REFERENCE_THREADS)
    plans += [plan_kernel(problem, reference, profile) for problem in problems()]
    results = gpu.precompile(plans)
    failures = {k: r.reason for k, r in results.items() if isinstance(r, CompileFailure)}
    assert not failures
    yield gpu
    gpu.close()


def test_environment_describes_the_device(backend: PyCudaBackend) -> None:
    environment = backend.environment()
    profile = backend.device_profile()
    assert environment["gpu_name"] == profile.name
    assert environment["compute_capability"] == "{}.{}".format(*profile.compute_capability)
    assert profile.sm_count > 0 and profile.l2_bytes > 0
    assert profile.max_shared_memory_per_block_optin >= 48 * 1024


@pytest.mark.parametrize("problem", problems(), ids=lambda p: p.label().replace(" ", "-"))
def test_every_family_matches_the_reference(backend: PyCudaBackend, problem: Problem) -> None:
    wrong = []
    for plan in plans_for(problem, backend.device_profile()):
        result = backend.measure(plan, problem)
        if not result.ok:
            wrong.append(f"{plan.key()}: {result.failure} {result.detail}")
            assert result.failure is not Failure.RUNTIME_DEVICE, wrong[-1]
            continue
        assert result.max_abs_error is not None
        assert result.max_abs_error <= FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS
    assert not wrong, "\n".join(wrong)


def test_split_plans_are_in_the_matrix(backend: PyCudaBackend) -> None:
    splits = {
        plan.sequence_splits
        for problem in problems()
        for plan in plans_for(problem, backend.device_profile())
    }
    assert max(splits) >= 32 and 1 in splits
