"""The Hopper family (``wgmma_f16``: TMA, wgmma, warp specialization) on a real GPU: parity over
dtype x head_dim (64, 96, 128; 192 and 256 below) x odd lengths x causal x GQA / KV-cache
lengths x consumer/tile/stage/overlap/split plans, each measured through the PyCUDA backend
exactly as a tuning trial is (tensor maps encoded by the driver, outputs poisoned with NaN,
FlashAttention's parity rule of ``kernels.precision``). Plans the planner rejects only as
larger than a tiny sequence needs are run anyway: they must be right too. Skipped where pycuda
is missing, no CUDA device answers, or the device is not sm_90.
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
FAMILY = family_named("wgmma_f16")
NAMES = ("consumers", "block_n", "stages", "blocks_per_sm", "overlap", "split_target",
         "pingpong", "staged_store", "persistent", "late_pack", "rescale_slack")
#: two consumer warpgroups and one (two blocks an SM), 64- and 128-key tiles, 2-4 stages,
#: with and without the softmax/P V overlap and the ping-pong, the output from registers or
#: staged through shared memory (in 16-byte rows or by TMA stores), split targets giving
#: several splits, and persistent blocks
PLANS = (
    (2, 128, 2, 1, 0, 1 << 16, 0, 0, 0),
    (2, 128, 3, 1, 1, 1 << 16, 0, 0, 0),
    (1, 64, 2, 2, 0, 3, 0, 0, 0),
    (2, 64, 4, 1, 1, 2, 0, 0, 0),
    (1, 64, 2, 2, 1, 1 << 16, 0, 0, 0),
    (2, 128, 3, 1, 1, 1 << 16, 1, 0, 0),
    (2, 64, 2, 1, 1, 2, 1, 0, 0),
    (2, 128, 3, 1, 1, 1 << 16, 1, 1, 0),
    (1, 64, 2, 2, 0, 1 << 16, 0, 1, 0),
    (2, 128, 2, 1, 0, 1 << 16, 0, 0, 1),
    (2, 128, 3, 1, 1, 1 << 16, 1, 1, 1),
    (1, 64, 2, 2, 1, 1 << 16, 0, 0, 1),
    (2, 64, 3, 1, 1, 1 << 16, 0, 1, 1),
    # the epilogue by TMA stores (staged_store 2), one block a row block and persistent
    (2, 128, 3, 1, 1, 1 << 16, 1, 2, 0),
    (2, 64, 3, 1, 1, 1 << 16, 1, 2, 1),
    # the rescale slack: a stale max within 2^8 and skipped rescales; one with splits
    (2, 128, 3, 1, 1, 1 << 16, 1, 1, 0, 0, 8),
    (2, 64, 2, 1, 1, 2, 0, 0, 0, 0, 8),
)
#: size-only verdicts: the plans are run anyway (a persistent plan of a few row blocks
#: walks one each)
SIZE_ONLY_REASONS = ("larger than needed", "nothing for a persistent block to walk")
#: persistent plans are made for a device of this many SMs, so that each block of the
#: small problems here walks several row blocks (the ring's and Q's barrier phases carry on
#: from one to the next, and the items do not divide evenly among the blocks); the kernel
#: reads only gridDim, never the SM count
PERSISTENT_SMS = 5


def params_of(values: tuple[int, ...]) -> KernelParams:
    """A plan row of NAMES (rows written before a later name leave it 0)."""
    padded = values + (0,) * (len(NAMES) - len(values))
    return KernelParams("wgmma_f16", **dict(zip(NAMES, padded, strict=True)))


def planning_profile(params: KernelParams, profile):
    """``profile``, or for a persistent plan the same device with PERSISTENT_SMS SMs."""
    return dataclasses.replace(profile, sm_count=PERSISTENT_SMS) if params.persistent else profile


def problems() -> list[Problem]:
    shapes = itertools.product((7, 129, 1000), (64, 96, 128), ("bfloat16", "float16"),
                               (False, True))
    found = [Problem(n, d, batch=2, heads=3, causal=c, dtype=t) for n, d, t, c in shapes]
    found += [
        # head_dim 96 in the 64-byte swizzle, with GQA, a KV cache and the variants
        Problem(200, 96, heads=8, kv_heads=2, kv_len=1100, causal=True, dtype="bfloat16",
                window_left=300, softcap=30.0, sinks=True),
        Problem(100, 128, heads=8, kv_heads=2, kv_len=1500, causal=True, dtype="bfloat16"),
        Problem(333, 64, batch=2, heads=4, kv_heads=1, kv_len=777, dtype="float16"),
        Problem(1, 128, batch=3, heads=8, kv_heads=2, kv_len=4100, dtype="bfloat16"),
    ]
    return found


def planned(problem: Problem, rows, profile) -> list[KernelPlan]:
    """The plans of ``rows`` (of NAMES) for ``problem``; those refused only for size are run
    anyway."""
    plans = []
    for values in rows:
        params = params_of(values)
        plan = FAMILY.plan(problem, params, planning_profile(params, profile))
        if not plan.feasible:
            assert any(r in plan.reason for r in SIZE_ONLY_REASONS), plan.reason
            plan = dataclasses.replace(plan, feasible=True, reason="")
        plans.append(plan)
    return plans


def plans_for(problem: Problem, profile) -> list[KernelPlan]:
    return planned(problem, PLANS, profile)


@pytest.fixture(scope="module")
def backend():
    gpu = PyCudaBackend(cache_dir=CACHE_DIR, repetitions=2, warmup=1, judge_resources=False, seed=7)
    try:
        profile = gpu.device_profile()
    except BackendError as error:
        pytest.skip(f"no GPU to run on: {error}")
    if profile.compute_capability != (9, 0):
        pytest.skip(f"wgmma_f16 needs sm_90a; the device is {profile.arch}")
    plans = [plan for problem in problems() for plan in plans_for(problem, profile)]
    plans += [plan for problem in key_tile_problems() for plan in key_tile_plans(problem, profile)]
    results = gpu.precompile(plans)
    failures = {k: r.reason for k, r in results.items() if isinstance(r, CompileFailure)}
    assert not failures
    yield gpu
    gpu.close()


@pytest.mark.parametrize("problem", problems(), ids=lambda p: p.label().replace(" ", "-"))
def test_wgmma_f16_matches_the_reference(backend: PyCudaBackend, problem: Problem) -> None:
    wrong = []
    for plan in plans_for(problem, backend.device_profile()):
        result = backend.measure(plan, problem)
        if not result.ok:
            wrong.append(f"{plan.key()}: {result.failure} {result.detail}")
            assert result.failure is not Failure.RUNTIME_DEVICE, wrong[-1]
            continue
        assert result.max_abs_error is not None and result.max_abs_error == result.max_abs_error
    assert not wrong, "\n".join(wrong)


def test_the_matrix_has_split_plans_overlap_and_both_consumer_counts(
    backend: PyCudaBackend,
) -> None:
    plans = [plan for p in problems() for plan in plans_for(p, backend.device_profile())]
    assert max(plan.sequence_splits for plan in plans) >= 3
    assert {plan.params.consumers for plan in plans} == {1, 2}
    assert {plan.params.overlap for plan in plans} == {0, 1}
    # persistent blocks walking several row blocks each (and one each)
    walks = [plan.waves for plan in plans if plan.params.persistent]
    assert max(walks) >= 5 and min(walks) <= 1


#: a stored wgmma plan with key splits (merge and scratch) on the deploy shape below
DEPLOY_STORED = {
    "consumers": 2,
    "block_n": 128,
    "stages": 3,
    "blocks_per_sm": 1,
    "overlap": 1,
    "split_target": 4,
}
#: and a persistent one (256 row blocks walked by a block per SM, ping-pong, staged store)
DEPLOY_PERSISTENT = DEPLOY_STORED | {
    "split_target": 1 << 16, "pingpong": 1, "staged_store": 1, "persistent": 1
}
#: and one storing by TMA through the output's map, which each call re-points at its output
DEPLOY_TMA_STORE = DEPLOY_PERSISTENT | {"staged_store": 2}


@pytest.mark.parametrize("stored_params", [DEPLOY_STORED, DEPLOY_PERSISTENT, DEPLOY_TMA_STORE],
                         ids=["splits", "persistent", "tma-store"])
def test_kernels_attention_serves_a_stored_wgmma_plan(tmp_path, stored_params) -> None:
    """The deploy path with TMA descriptors: a GQA causal bf16 call against a stored wgmma plan
    is right, stays right when the tensors move (the maps are re-pointed), and a CUDA graph of
    the call replays the eager result."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("sqlalchemy")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 device that torch sees")
    import kernels
    import kernels.deploy as ka
    from db import PlanRecord, PlanRegistry
    from kernels import build
    from kernels.deploy import Attention

    batch, heads, kv_heads, n, d = 2, 16, 4, 1000, 128
    problem = Problem(
        n, d, batch=batch, heads=heads, kv_heads=kv_heads, causal=True, dtype="bfloat16"
    )
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    with PlanRegistry.open(url) as writer:
        probe = Attention(writer)
        stored = PlanRecord(
            "wgmma_f16", dict(stored_params), build.source_hash("wgmma_f16"), True, median_ms=1.0
        )
        writer.record(problem, probe.environment(), stored)
        probe.close()

    def tensors(seed: int) -> list:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        return [
            torch.randn((batch, h, n, d), device="cuda", dtype=torch.bfloat16, generator=generator)
            for h in (heads, kv_heads, kv_heads)
        ]

    def errors(out, q, k, v) -> tuple[float, float]:
        group = heads // kv_heads
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
        scores = q64 @ k64.transpose(-1, -2) / d**0.5
        above = torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1)
        want = torch.softmax(scores.masked_fill(above, float("-inf")), dim=-1) @ v64
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (
            float((out.double() - want).abs().max()),
            float((theirs.double() - want).abs().max()),
        )

    with torch.no_grad():
        for seed in (1, 2):  # new tensors: new addresses for the maps
            q, k, v = tensors(seed)
            out = kernels.attention(q, k, v, True, registry=url)
            ours, theirs = errors(out, q, k, v)
            assert ours <= 2 * theirs + 1e-5, f"seed {seed}: {ours:.2e} vs torch {theirs:.2e}"
        chosen = ka.default_instance(url).plan_for(problem)
        assert chosen.origin == "registry" and chosen.plan.family == "wgmma_f16"
        if stored_params.get("persistent"):
            assert chosen.plan.params.persistent == 1 and chosen.plan.launch.grid[1:] == (1, 1)
        else:
            assert chosen.plan.sequence_splits > 1
        static = tensors(3)
        eager = kernels.attention(*static, True, registry=url)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = kernels.attention(*static, True, registry=url)
        for target, source in zip(static, tensors(4), strict=True):
            target.copy_(source)
        graph.replay()
        fresh = kernels.attention(*static, True, registry=url)
        torch.cuda.synchronize()
        assert torch.equal(captured, fresh) and not torch.equal(captured, eager)
    ka.clear_default_instances()


#: head_dim 192 and 256: the O accumulators leave room for 64-key tiles only (the planner
#: refuses 128-key ones for registers and shared memory), two consumers or one
WIDE_PLANS = (
    (2, 64, 2, 1, 0, 1 << 16, 0, 0, 0),
    (2, 64, 2, 1, 1, 1 << 16, 0, 0, 0),
    (1, 64, 3, 1, 1, 1 << 16, 0, 0, 0),
    (1, 64, 2, 1, 0, 2, 0, 0, 0),
    (2, 64, 2, 1, 1, 1 << 16, 1, 0, 0),
    (2, 64, 2, 1, 0, 1 << 16, 0, 1, 0),
    (2, 64, 2, 1, 0, 1 << 16, 0, 1, 1),
)


def wide_problems() -> list[Problem]:
    shapes = itertools.product((7, 129, 1000), (192, 256), ("bfloat16", "float16"), (False, True))
    found = [Problem(n, d, batch=2, heads=2, causal=c, dtype=t) for n, d, t, c in shapes]
    found.append(
        Problem(300, 256, heads=8, kv_heads=4, kv_len=900, causal=True, dtype="bfloat16",
                window_left=200, softcap=50.0)
    )
    return found


@pytest.mark.parametrize("problem", wide_problems(), ids=lambda p: p.label().replace(" ", "-"))
def test_wide_head_dims_match_the_reference(backend: PyCudaBackend, problem: Problem) -> None:
    wrong = []
    for plan in planned(problem, WIDE_PLANS, backend.device_profile()):
        result = backend.measure(plan, problem)
        if not result.ok:
            wrong.append(f"{plan.key()}: {result.failure} {result.detail}")
            assert result.failure is not Failure.RUNTIME_DEVICE, wrong[-1]
    assert not wrong, "\n".join(wrong)


#: key tiles between and past 64 and 128 (FlashAttention-3's: 192/176 at head_dim 64, 144 at
#: 96, 176 at 128, 112 at 192, 80 at 256), P packed late into one register set or early
#: into two, with the ping-pong, the staged store, persistent blocks and splits, and three
#: consumers (192-row blocks) at head_dim 64 and 96. Without a
#: mask or variant each compiles clean (no spill, no serialised wgmma) with ptxas, as the
#: planner predicts; the mask's registers spill some (80-key tiles at head_dim 256 with the
#: ping-pong, 12 B; 144-176-key ones at 128 with window, softcap and sinks, 52-320 B), which
#: the tuner's precompile drops; they run here all the same. At head_dim 256 the staged store
#: or the persistent loop spill 80-key tiles even unmasked (8-100 B): not listed.
T = 1 << 16
KEY_TILE_PLANS = {
    64: ((2, 192, 3, 1, 1, T, 1, 0, 0, 1), (2, 176, 3, 1, 1, T, 1, 1, 0, 1),
         (2, 144, 4, 1, 1, T, 0, 0, 1, 1),
         # three consumers (192-row blocks): the three-way ping-pong, persistent, and split
         (3, 128, 2, 1, 1, T, 1, 0, 0, 1), (3, 96, 3, 1, 1, T, 1, 1, 1, 1),
         (3, 128, 2, 1, 0, 2, 0, 0, 0, 0), (3, 128, 2, 1, 1, T, 1, 2, 1, 1, 8)),
    96: ((2, 144, 2, 1, 1, T, 1, 1, 0, 1), (1, 176, 2, 1, 1, 2, 0, 0, 0, 1),
         (3, 96, 2, 1, 1, T, 1, 0, 0, 1), (3, 96, 4, 1, 1, T, 0, 2, 0, 1)),
    128: ((2, 176, 2, 1, 1, T, 1, 0, 0, 1), (2, 160, 2, 1, 1, T, 1, 1, 1, 1),
          (2, 144, 2, 1, 1, 2, 0, 0, 0, 1), (2, 112, 3, 1, 0, T, 0, 0, 0, 0)),
    192: ((2, 112, 2, 1, 1, T, 1, 1, 0, 1), (2, 96, 2, 1, 1, T, 0, 0, 1, 1)),
    256: ((2, 80, 2, 1, 1, T, 1, 0, 0, 1), (2, 80, 2, 1, 1, T, 0, 0, 0, 1),
          (2, 80, 2, 1, 1, T, 0, 0, 0, 1, 8)),
}  # fmt: skip


def key_tile_problems() -> list[Problem]:
    shapes = itertools.product((129, 1000), sorted(KEY_TILE_PLANS), ("bfloat16", "float16"),
                               (False, True))
    found = [Problem(n, d, batch=2, heads=2, causal=c, dtype=t) for n, d, t, c in shapes]
    found.append(
        Problem(300, 128, heads=8, kv_heads=2, kv_len=1500, causal=True, dtype="bfloat16",
                window_left=200, softcap=30.0, sinks=True)
    )
    return found


def key_tile_plans(problem: Problem, profile) -> list[KernelPlan]:
    return planned(problem, KEY_TILE_PLANS[problem.head_dim], profile)


@pytest.mark.parametrize(
    "problem", key_tile_problems(), ids=lambda p: p.label().replace(" ", "-")
)
def test_key_tiles_past_128_and_between_match_the_reference(
    backend: PyCudaBackend, problem: Problem
) -> None:
    from kernels import build

    profile = backend.device_profile()
    wrong = []
    for plan in key_tile_plans(problem, profile):
        compiled = build.compile_kernel(plan, CACHE_DIR, arch=profile.arch)
        judged = plan.with_resources(compiled.primary_resources, profile)
        if not problem.causal and not problem.sinks:
            assert judged.feasible, f"{plan.key()}: {judged.reason}"
        result = backend.measure(plan, problem)
        if not result.ok:
            wrong.append(f"{plan.key()}: {result.failure} {result.detail}")
            assert result.failure is not Failure.RUNTIME_DEVICE, wrong[-1]
    assert not wrong, "\n".join(wrong)
