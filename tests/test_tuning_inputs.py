"""What variant problems are tuned on, and the tuning backend running them on a fake GPU.

The inputs must make every variant matter: a kernel that ignored the window, the softcap, the
ALiBi slopes or the sinks must fail the parity check. The PyCUDA backend uploads the slopes and
sinks once per problem, passes their addresses in ``DeviceBuffers`` and checks the output
against a reference that uses the same float32 values; ``tests/variant_family.py``'s toy
family takes them as the kernel ABI says.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from test_pycuda_backend import KERNELS, FakeGpu, backend
from test_pycuda_backend import gpu as gpu  # noqa: PLC0414 - the fake driver's fixture
from variant_family import ENTRY, emulated_attention, toy_variants_only

from kernels import precision
from kernels.attention_variants import alibi_slopes
from kernels.backends.base import Failure
from kernels.reference import reference_rows
from kernels.tuning_inputs import SOFTCAP_LOGIT_STD, tuning_inputs
from tuner.device import H200
from tuner.planner.tunable import KernelParams, plan_kernel
from tuner.problem import Problem


def test_a_problem_without_variants_gets_the_draws_it_always_had() -> None:
    problem = Problem(40, 16, batch=2, heads=4, kv_heads=2, kv_len=70, dtype="bfloat16")
    inputs = tuning_inputs(problem, np.random.default_rng(7))
    stored, values = precision.random_inputs(problem, np.random.default_rng(7))
    for mine, theirs in zip((*inputs.stored, *inputs.values), (*stored, *values), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert inputs.alibi_slopes is None and inputs.sinks is None


def test_softcap_inputs_put_logits_in_the_hundreds() -> None:
    problem = Problem(64, 128, heads=2, kv_len=1000, softcap=50.0, dtype="bfloat16")
    q, k, _ = tuning_inputs(problem, np.random.default_rng(0)).values
    logits = q @ k.transpose(0, 2, 1) / math.sqrt(128)
    assert logits.std() == pytest.approx(SOFTCAP_LOGIT_STD, rel=0.1)
    row_peaks = np.abs(logits).max(axis=-1)
    assert np.median(row_peaks) > 250  # far past the cap in every row, not in a few
    dense = tuning_inputs(Problem(64, 128, heads=2, kv_len=1000), np.random.default_rng(0))
    assert np.abs(dense.values[0] @ dense.values[1].transpose(0, 2, 1)).max() < 100


def test_alibi_slopes_are_the_standard_ones_in_float32() -> None:
    problem = Problem(8, 16, heads=12, alibi=True)
    inputs = tuning_inputs(problem, np.random.default_rng(0))
    assert inputs.alibi_slopes is not None and inputs.alibi_slopes.dtype == np.float32
    np.testing.assert_array_equal(inputs.alibi_slopes, alibi_slopes(12).astype(np.float32))
    np.testing.assert_array_equal(inputs.variants.alibi_slopes, inputs.alibi_slopes)


@pytest.mark.parametrize(
    "problem",
    [
        Problem(300, 64, heads=8, kv_heads=2, kv_len=2000, causal=True, sinks=True),
        Problem(1, 128, batch=4, heads=32, kv_heads=8, kv_len=4000, sinks=True),
        Problem(200, 64, heads=4, causal=True, window_left=30, softcap=20.0, sinks=True),
    ],
    ids=lambda p: p.label(),
)
def test_sinks_take_a_real_share_of_every_heads_weight(problem: Problem) -> None:
    inputs = tuning_inputs(problem, np.random.default_rng(1))
    q, k, v = inputs.values
    assert inputs.sinks is not None and inputs.sinks.dtype == np.float32
    np.testing.assert_array_equal(inputs.variants.sinks, inputs.sinks)
    rows = np.arange(problem.seq_len)
    heads = np.arange(problem.batch_heads)
    _, with_sinks = reference_rows(
        q, k, v, problem.causal, heads, rows, problem.group, inputs.variants, lse=True
    )
    sinks = inputs.variants.sinks[heads % problem.heads]
    share = np.exp(sinks[:, None] - with_sinks)  # the sink's part of each row's denominator
    median = np.median(share, axis=1)
    assert median.min() > 0.15 and median.max() < 0.97, median


# ---------------------------------------------------------------------------- on the fake GPU


@pytest.fixture
def toy(gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch):
    gpu.ignore = ""

    def kernel(gpu: FakeGpu, defines: dict[str, int], grid: Any, *args: Any) -> None:
        emulated_attention(gpu, defines, grid, *args, ignore=gpu.ignore)

    monkeypatch.setitem(KERNELS, ENTRY, kernel)
    with toy_variants_only() as family:
        yield family


VARIANT_PROBLEMS = {
    "window": Problem(
        50, 16, batch=2, heads=4, kv_heads=2, kv_len=90, causal=True, window_left=9
    ),
    "softcap": Problem(40, 32, heads=2, kv_len=60, softcap=30.0),
    "alibi": Problem(30, 16, heads=8, kv_heads=2, kv_len=50, causal=True, alibi=True),
    "sinks": Problem(4, 32, batch=2, heads=8, kv_heads=1, kv_len=300, sinks=True),
}


def toy_plan(problem: Problem):
    plan = plan_kernel(problem, KernelParams("toy_variants", threads=64, block_m=16), H200)
    assert plan.feasible, plan.reason
    return plan


@pytest.mark.parametrize("variant", sorted(VARIANT_PROBLEMS))
def test_a_kernel_that_takes_the_variant_passes_one_that_ignores_it_fails(
    toy: Any, gpu: FakeGpu, variant: str
) -> None:
    problem = VARIANT_PROBLEMS[variant]
    measuring = backend(flush_l2=False)
    right = measuring.measure(toy_plan(problem), problem)
    assert right.ok, right.detail
    assert right.max_abs_error is not None and right.max_abs_error < 1e-5
    gpu.ignore = variant
    wrong = measuring.measure(toy_plan(problem), problem)
    assert wrong.failure is Failure.WRONG_ANSWER and wrong.max_abs_error > 1e-2, wrong.detail


def test_every_variant_at_once_runs_on_the_uploaded_slopes_and_sinks(
    toy: Any, gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    problem = Problem(
        33, 16, batch=2, heads=6, kv_heads=3, kv_len=45, causal=True, window_left=12,
        softcap=20.0, alibi=True, sinks=True,
    )
    launched: list[tuple[Any, ...]] = []
    kernel = KERNELS[ENTRY]
    monkeypatch.setitem(KERNELS, ENTRY, lambda *a: launched.append(a[3:]) or kernel(*a))
    measuring = backend(flush_l2=False, repetitions=1, warmup=0)
    result = measuring.measure(toy_plan(problem), problem)
    assert result.ok, result.detail
    arguments = launched[0]
    # heads, window_left, window_right (causal: the diagonal bounds the right), softcap
    assert [int(a) for a in arguments[11:14]] == [6, 12, -1] and float(arguments[14]) == 20.0
    slopes_at, sinks_at, lse_at = (int(a) for a in arguments[15:18])
    assert slopes_at and sinks_at and lse_at == 0  # tuning asks for no LSE
    np.testing.assert_array_equal(gpu.floats(slopes_at, 6), alibi_slopes(6).astype(np.float32))
    state = measuring._state
    assert state is not None
    np.testing.assert_array_equal(gpu.floats(sinks_at, 6), state.variants.sinks)
    assert len(launched) == 2  # the checked run and one timed run


def test_a_run_asked_for_the_lse_gets_a_poisoned_buffer_and_reads_it_back(
    toy: Any, gpu: FakeGpu
) -> None:
    problem = Problem(
        24, 16, batch=2, heads=4, kv_heads=2, kv_len=40, causal=True, window_left=5,
        alibi=True, sinks=True,
    )
    measuring = backend(flush_l2=False)
    plan = toy_plan(problem)
    out, lse = measuring.output(plan, problem, lse=True)
    q, k, v = measuring.inputs(problem)
    variants = measuring.variants(problem)
    want_out, want_lse = reference_rows(
        q, k, v, True, np.arange(8), np.arange(24), problem.group, variants, lse=True
    )
    np.testing.assert_allclose(out.reshape(8, 24, 16), want_out, atol=1e-5)
    assert lse.shape == (8, 24) and lse.dtype == np.float32
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    gpu.ignore = "sinks"  # a kernel that leaves the sinks out of its LSE
    _, wrong = measuring.output(plan, problem, lse=True)
    assert np.abs(wrong - want_lse).max() > 0.1
    assert isinstance(measuring.output(plan, problem), np.ndarray)  # not asked: no LSE
