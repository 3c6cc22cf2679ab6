"""The Hopper backward (``wgmma_f16_bwd``) on a real H200, in seconds.

* Through the PyCUDA backend, as a tuning trial, on test_gpu_backward.py's problems (dtype x
  head_dim 64/128 x odd lengths x causal x GQA/MQA x kv_len != seq_len, and the variants:
  window, softcap + ALiBi + sinks): the atomic plan with the whole group in one block and the
  deterministic plan with the group split in shares; dQ, dK, dV against float64 by
  FlashAttention's rule, the detail naming every gradient's error on failure.
* Through ``kernels.attention(...).backward()`` with no registry: the fallback serves this
  family on sm_90, its gradients pass against float64 autograd, and its deterministic mode
  gives identical bits across runs.

Skipped where torch, pycuda or a CUDA device is missing, or the device is not sm_90.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_gpu_backward import (
    CACHE_DIR,
    VARIANTS,
    check_against_float64,
    gradients,
    leaves,
    problems,
    say,
)
from test_gpu_backward import no_registry as no_registry  # noqa: PLC0414 - fixtures
from test_gpu_backward import torch as torch  # noqa: PLC0414

from kernels.backends.pycuda_backend import PyCudaBackend
from kernels.build import CompileFailure
from tuner.errors import BackendError
from tuner.planner.families import family_named
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan
from tuner.problem import Problem

pytestmark = pytest.mark.gpu

FAMILY = family_named("wgmma_f16_bwd")


def plans_for(problem: Problem, profile: Any) -> list[KernelPlan]:
    choices = [
        {"block_m": 64},
        {"block_m": 64, "deterministic": 1, "group_split": problem.group},
    ]
    plans = [FAMILY.plan(problem, KernelParams(FAMILY.name, **c), profile) for c in choices]
    for plan in plans:
        assert plan.feasible or "larger than needed" in plan.reason, plan.reason
    return [
        plan if plan.feasible else dataclasses.replace(plan, feasible=True, reason="")
        for plan in plans
    ]


@pytest.fixture(scope="module")
def backend():
    pytest.importorskip("pycuda.driver")
    gpu = PyCudaBackend(cache_dir=CACHE_DIR, repetitions=2, warmup=1, seed=3)
    try:
        profile = gpu.device_profile()
    except BackendError as error:
        pytest.skip(f"no GPU to run on: {error}")
    if profile.compute_capability != (9, 0):
        pytest.skip(f"wgmma_f16_bwd needs sm_90; the device is {profile.arch}")
    plans = [plan for problem in problems() + VARIANTS for plan in plans_for(problem, profile)]
    results = gpu.precompile(plans)
    failures = {k: r.reason for k, r in results.items() if isinstance(r, CompileFailure)}
    assert not failures
    yield gpu
    gpu.close()


@pytest.mark.parametrize(
    "problem", problems() + VARIANTS, ids=lambda p: p.label().replace(" ", "-")
)
def test_wgmma_backward_matches_float64_through_the_backend(backend, problem, capsys) -> None:
    wrong = []
    for plan in plans_for(problem, backend.device_profile()):
        result = backend.measure(plan, problem)
        say(capsys, f"{problem.label()} {plan.key()}: {result.failure or 'ok'} {result.detail}")
        if not result.ok:
            wrong.append(f"{plan.key()}: {result.failure} {result.detail}")
            continue
        assert result.forward_ms and result.median_ms and result.tflops
    assert not wrong, "\n".join(wrong)


def test_attention_serves_the_wgmma_backward_deterministically(torch, no_registry, capsys) -> None:
    import kernels

    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip("the Hopper backward runs on sm_90")
    shape, kv_shape = (2, 8, 1000, 128), (2, 2, 1000, 128)
    inputs, dout = leaves(torch, shape, kv_shape, torch.bfloat16, seed=8)
    problem = Problem(1000, 128, batch=2, heads=8, kv_heads=2, causal=True, dtype="bfloat16",
                      direction="backward")  # fmt: skip
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            runs.append(gradients(torch, lambda *x: kernels.attention(*x, causal=True), inputs,
                                  dout))  # fmt: skip
        handle = (
            kernels.deploy.default_instance(None)
            ._runner(0)
            .backward_handle(problem, deterministic=True)
        )
    finally:
        torch.use_deterministic_algorithms(False)
    assert handle.plan.params.family == FAMILY.name and handle.plan.params.deterministic
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)
    say(capsys, f"fallback {handle.plan.key()}: "
        f"{check_against_float64(torch, runs[0], inputs, dout, True)}")  # fmt: skip
