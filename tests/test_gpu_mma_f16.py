"""The bf16/fp16 tensor-core family on a real GPU: parity over dtype x head_dim x odd
sequence lengths x causal x several batch-heads x tile/stage/split plans.

Each measurement goes through the PyCUDA backend exactly as a tuning trial
does: inputs rounded to the dtype, outputs poisoned with NaN, the answer
checked against a float64 reference of the same rounded inputs with
FlashAttention's rule (``kernels.precision``: at most twice torch SDPA's own
error plus a floor, or the documented per-dtype tolerance without torch).
Plans the planner rejects only as larger than a tiny sequence needs, and
plans whose ptxas report shows spills, are run anyway: they must be right
too. Skipped where pycuda is missing or no CUDA device answers.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest

from kernels.backends.base import Failure
from kernels.backends.pycuda_backend import DEFAULT_CACHE_DIR, PyCudaBackend
from kernels.build import CompileFailure
from tuner.errors import BackendError
from tuner.planner.families import family_named
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan
from tuner.problem import Problem

pytestmark = pytest.mark.gpu

CACHE_DIR = os.environ.get("FLASH_ATTENTION_TUNER_CUBIN_CACHE", DEFAULT_CACHE_DIR)
FAMILY = family_named("mma_f16")
#: (block_m, block_n, warps, stages, q_in_registers, s_groups, split_target): 16 and
#: 32 rows a warp, Q in registers and in shared memory, 2 and 3 stages, S for both m
#: tiles at once and one at a time, 48-key tiles (an odd number of n16 pairs), and
#: split targets that give several splits at 1000 keys.
PLANS = (
    (64, 32, 4, 2, 1, 1, 1),
    (128, 64, 8, 3, 1, 1, 1 << 16),
    (128, 64, 4, 2, 0, 2, 4),
    (256, 48, 8, 2, 0, 1, 2),
    (256, 64, 8, 2, 0, 2, 1 << 16),
    (64, 64, 4, 2, 0, 1, 1 << 16),
)
#: head_dim 256 keeps Q in shared memory (its fragments alone are 64 registers a row tile)
PLANS_256 = ((64, 64, 4, 2, 0, 1, 1 << 16), (64, 32, 4, 2, 0, 1, 3))
NAMES = ("block_m", "block_n", "warps", "stages", "q_in_registers", "s_groups", "split_target")
SIZE_ONLY_REASONS = ("larger than needed",)


def problems() -> list[Problem]:
    shapes = [
        (n, d, dtype, causal)
        for n, d, dtype, causal in itertools.product(
            (7, 129, 1000), (64, 96, 128), ("bfloat16", "float16"), (False, True)
        )
    ]
    shapes += [(n, 256, dtype, True) for n in (129, 1000) for dtype in ("bfloat16", "float16")]
    shapes += [(1, 128, "bfloat16", False), (1, 64, "float16", True)]
    return [Problem(n, d, batch=2, heads=3, causal=c, dtype=t) for n, d, t, c in shapes]


def plans_for(problem: Problem, profile) -> list[KernelPlan]:
    plans = []
    for values in PLANS_256 if problem.head_dim == 256 else PLANS:
        params = KernelParams("mma_f16", **dict(zip(NAMES, values, strict=True)))
        plan = FAMILY.plan(problem, params, profile)
        if not plan.feasible:
            assert any(r in plan.reason for r in SIZE_ONLY_REASONS), plan.reason
            plan = dataclasses.replace(plan, feasible=True, reason="")
        plans.append(plan)
    return plans


@pytest.fixture(scope="module")
def backend():
    gpu = PyCudaBackend(cache_dir=CACHE_DIR, repetitions=2, warmup=1, judge_resources=False, seed=5)
    try:
        profile = gpu.device_profile()
    except BackendError as error:
        pytest.skip(f"no GPU to run on: {error}")
    plans = [plan for problem in problems() for plan in plans_for(problem, profile)]
    results = gpu.precompile(plans)
    failures = {k: r.reason for k, r in results.items() if isinstance(r, CompileFailure)}
    assert not failures
    yield gpu
    gpu.close()


@pytest.mark.parametrize("problem", problems(), ids=lambda p: p.label().replace(" ", "-"))
def test_mma_f16_matches_the_reference(backend: PyCudaBackend, problem: Problem) -> None:
    wrong = []
    for plan in plans_for(problem, backend.device_profile()):
        result = backend.measure(plan, problem)
        if not result.ok:
            wrong.append(f"{plan.key()}: {result.failure} {result.detail}")
            assert result.failure is not Failure.RUNTIME_DEVICE, wrong[-1]
            continue
        assert result.max_abs_error is not None and result.max_abs_error == result.max_abs_error
    assert not wrong, "\n".join(wrong)


def test_the_matrix_has_split_plans_and_both_warp_shapes(backend: PyCudaBackend) -> None:
    plans = [plan for p in problems() for plan in plans_for(p, backend.device_profile())]
    splits = {plan.sequence_splits for plan in plans}
    assert 1 in splits and 2 in splits and max(splits) >= 4
    assert {plan.params.block_m // plan.params.warps for plan in plans} == {16, 32}
    assert {plan.params.s_groups for plan in plans} == {1, 2}
