"""The float32 tensor-core family on a real GPU: parity over head_dim x odd sequence
lengths x causal x tile/stage/split plans x both precisions.

Each measurement goes through the PyCUDA backend exactly as a tuning trial
does: random normal float32 inputs, outputs poisoned with NaN, the answer
checked against a float64 reference with the problem's precision rule
(``kernels.precision``): ``tf32x3`` plans (three passes) at most twice torch's
float32 SDPA error plus 2^-20, ``tf32`` plans (one pass) at most twice the
error of a TF32-rounded float64 attention plus 2^-11. One-pass plans must fail
the ``tf32x3`` rule (otherwise that rule could not tell the classes apart).
Plans the planner rejects only as larger than a tiny sequence needs, and plans
whose ptxas report shows spills, are run anyway: they must be right too.
Skipped where pycuda is missing or no CUDA device answers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
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
FAMILY = family_named("mma_tf32")
#: (block_m, block_n, warps, stages, split_target): 16 and 32 rows a warp, 2 and 3
#: stages, 32- and 64-key tiles, and split targets that give several splits at 1000 keys.
PLANS = (
    (64, 64, 4, 2, 1 << 16),
    (128, 32, 8, 3, 1 << 16),
    (64, 32, 2, 2, 4),
    (32, 64, 2, 2, 2),
    (128, 64, 8, 2, 3),
)
NAMES = ("block_m", "block_n", "warps", "stages", "split_target")
SIZE_ONLY_REASONS = ("larger than needed", "accumulator floats")


def problems() -> list[Problem]:
    shapes = itertools.product((1, 7, 129, 1000), (32, 64, 128), (False, True), ("tf32x3", "tf32"))
    return [
        Problem(n, d, batch=2, heads=3, causal=c, precision=precision)
        for n, d, c, precision in shapes
    ]


def plans_for(problem: Problem, profile, passes: int) -> list[KernelPlan]:
    plans = []
    for values in PLANS:
        named = dict(zip(NAMES, values, strict=True))
        plan = FAMILY.plan(problem, KernelParams("mma_tf32", passes=passes, **named), profile)
        if not plan.feasible:
            assert any(r in plan.reason for r in SIZE_ONLY_REASONS), plan.reason
            plan = dataclasses.replace(plan, feasible=True, reason="")
        plans.append(plan)
    return plans


def passes_of(problem: Problem) -> int:
    return 1 if problem.fast_tf32 else 3


@pytest.fixture(scope="module")
def backend():
    gpu = PyCudaBackend(cache_dir=CACHE_DIR, repetitions=2, warmup=1, judge_resources=False, seed=5)
    try:
        profile = gpu.device_profile()
    except BackendError as error:
        pytest.skip(f"no GPU to run on: {error}")
    plans = [
        plan for problem in problems() for plan in plans_for(problem, profile, passes_of(problem))
    ]
    results = gpu.precompile(plans)
    failures = {k: r.reason for k, r in results.items() if isinstance(r, CompileFailure)}
    assert not failures
    yield gpu
    gpu.close()


@pytest.mark.parametrize("problem", problems(), ids=lambda p: p.label().replace(" ", "-"))
def test_mma_tf32_matches_the_reference(backend: PyCudaBackend, problem: Problem) -> None:
    wrong = []
    for plan in plans_for(problem, backend.device_profile(), passes_of(problem)):
        result = backend.measure(plan, problem)
        if not result.ok:
            wrong.append(f"{plan.key()}: {result.failure} {result.detail}")
            assert result.failure is not Failure.RUNTIME_DEVICE, wrong[-1]
            continue
        assert result.max_abs_error is not None and result.max_abs_error == result.max_abs_error
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("n", (129, 1000))
def test_one_pass_fails_the_accurate_rule(backend: PyCudaBackend, n: int) -> None:
    """The tf32x3 rule separates the classes: a one-pass kernel, judged as if it served a
    tf32x3 problem, is a wrong answer (its error is about a thousand times larger)."""
    accurate = Problem(n, 128, batch=2, heads=3)
    (plan, *_) = plans_for(
        Problem(n, 128, batch=2, heads=3, precision="tf32"), backend.device_profile(), 1
    )
    result = backend.measure(dataclasses.replace(plan, problem=accurate), accurate)
    assert result.failure is Failure.WRONG_ANSWER, result
    (three, *_) = plans_for(accurate, backend.device_profile(), 3)
    passed = backend.measure(three, accurate)
    assert passed.ok and passed.max_abs_error is not None
    assert result.max_abs_error is not None and result.max_abs_error > 30 * passed.max_abs_error


def test_the_matrix_has_split_plans_and_both_warp_shapes(backend: PyCudaBackend) -> None:
    plans = [
        plan for p in problems() for plan in plans_for(p, backend.device_profile(), passes_of(p))
    ]
    splits = {plan.sequence_splits for plan in plans}
    assert 1 in splits and 2 in splits and max(splits) >= 4
    assert {plan.params.block_m // plan.params.warps for plan in plans} == {16, 32}
    assert {plan.params.passes for plan in plans} == {1, 3}


# ---------------------------------------------------------------------------- deploy path


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("sqlalchemy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device answers torch")
    return torch


def test_attention_serves_each_precision_its_own_plan(torch, tmp_path, monkeypatch) -> None:
    """``kernels.attention(..., precision=...)`` on float32 torch tensors: a one-pass plan
    stored for tf32 serves tf32 calls, never the default (tf32x3) ones, and each output is
    within its precision's limit of float64 (tf32x3: twice torch's efficient SDPA error +
    2^-20)."""
    from db import PlanRecord, PlanRegistry
    from kernels import build
    from kernels.deploy import Attention

    monkeypatch.chdir(tmp_path)
    shape, causal = (1, 4, 1000, 128), True
    problem = Problem(1000, 128, batch=1, heads=4, causal=causal, precision="tf32")
    one_pass = {
        "block_m": 64,
        "block_n": 64,
        "warps": 4,
        "stages": 2,
        "passes": 1,
        "split_target": 4,
    }
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    with PlanRegistry.open(url) as writer:
        probe = Attention(writer)
        record = PlanRecord(
            "mma_tf32", one_pass, build.source_hash("mma_tf32"), measured=True, median_ms=1.0
        )
        writer.record(problem, probe.environment(), record)
        probe.close()
    generator = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.float32, generator=generator)
        for _ in range(3)
    )
    attend = Attention(url)
    with torch.no_grad():
        fast = attend(q, k, v, causal, precision="tf32")
        accurate = attend(q, k, v, causal)
        want = (
            torch.softmax(
                (q.double() @ k.double().transpose(-1, -2) / math.sqrt(128)).masked_fill(
                    torch.ones(1000, 1000, dtype=torch.bool, device="cuda").triu(1), float("-inf")
                ),
                dim=-1,
            )
            @ v.double()
        )
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    fast_plan = attend.plan_for(problem).plan
    accurate_plan = attend.plan_for(dataclasses.replace(problem, precision="tf32x3")).plan
    assert fast_plan.params.passes == 1
    assert accurate_plan.family != "mma_tf32" or accurate_plan.params.passes == 3
    torch_error = float((theirs.double() - want).abs().max())
    accurate_error = float((accurate.double() - want).abs().max())
    fast_error = float((fast.double() - want).abs().max())
    assert accurate_error <= 2 * torch_error + 2.0**-20, (accurate_error, torch_error)
    assert 10 * accurate_error < fast_error < 4e-3, (fast_error, accurate_error)
    with pytest.raises(ValueError, match="applies to float32 inputs only"):
        attend(q.half(), k.half(), v.half(), causal, precision="tf32")
    attend.close()
