"""The kernel sources, unchanged, on a CPU emulator of the CUDA execution model
(``tests/device_emulation``): every index, fragment layout (ldmatrix, mma.sync, and for the
Hopper kernels wgmma's swizzled descriptors, the TMA, mbarriers, named barriers, stmatrix and
bulk reductions, at the PTX ISA's semantics), mask and barrier of the forward's LSE, of the
Hopper forward (its warp specialisation, overlap, ping-pong, persistent queue, split-KV merge),
of the decode kernel (GQA rows packed per KV head, split-KV) and of both backward families,
checked against float64 with the GPU backend's own rule, on a machine without a GPU. Needs g++ and
the CUDA headers; each case builds the plan's kernel once (cached) and runs in seconds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from device_emulation import emulate

from kernels import precision
from kernels.backward_parity import BackwardReference
from tuner.device import H200
from tuner.planner import KernelParams, plan_kernel
from tuner.problem import Problem

pytestmark = pytest.mark.skipif(bool(emulate.available()), reason=emulate.available() or "ok")

#: a small forward plan (whatever forward computes O and the LSE the backward reads)
FORWARD = {"block_m": 64, "block_n": 32, "warps": 4, "stages": 2, "split_target": 1 << 16}

CASES = [
    # the default head_dim-128 plan (8 warps, 16 keys each), causal with kv_len > seq_len
    (
        Problem(130, 128, causal=True, dtype="bfloat16", kv_len=150),
        {"block_m": 64, "block_n": 128, "warps": 8, "stages": 2, "q_chunk": 16},
    ),
    # 32 keys a warp, single-buffered query tiles, float16, odd lengths
    (
        Problem(50, 64, heads=2, causal=True, dtype="float16", kv_len=91),
        {"block_m": 64, "block_n": 128, "warps": 4, "stages": 1, "q_chunk": 16},
    ),
    # MQA split over two shares (float32 dK/dV partials summed), deterministic dQ
    (
        Problem(45, 64, batch=2, heads=4, kv_heads=1, dtype="bfloat16", kv_len=70),
        {
            "block_m": 32,
            "block_n": 64,
            "warps": 4,
            "q_chunk": 16,
            "group_split": 2,
            "deterministic": 1,
        },
    ),  # fmt: skip
    # a window whose rows past kv_len see no key at all (LSE +inf), deterministic order
    (
        Problem(70, 64, heads=2, dtype="bfloat16", kv_len=40, window_left=5, window_right=0),
        {"block_m": 32, "block_n": 64, "warps": 4, "q_chunk": 16, "deterministic": 1},
    ),
    # softcap (its derivative), ALiBi and sinks (their gradient), causal
    (
        Problem(
            33, 64, heads=2, causal=True, dtype="bfloat16", softcap=3.0, alibi=True, sinks=True
        ),
        {"block_m": 32, "block_n": 64, "warps": 4, "q_chunk": 32},
    ),  # fmt: skip
]


#: the Hopper backward (wgmma, stmatrix, bulk reductions emulated: include/fa/hopper.cuh and
#: wgmma_ops.cuh beside the emulator): the swizzled descriptors of every product, the
#: transposed dS, the tiled dQ accumulator and its cast
WGMMA_CASES = [
    # head_dim 128 (dQ split by 64-column chunks), causal with kv_len > seq_len, odd lengths
    (Problem(130, 128, causal=True, dtype="bfloat16", kv_len=150), {}),
    # head_dim 64 (a warpgroup's dQ columns start mid-row), float16, GQA in two shares,
    # deterministic
    (
        Problem(70, 64, heads=4, kv_heads=2, dtype="float16", kv_len=90),
        {"deterministic": 1, "group_split": 2},
    ),
    # a window, softcap, ALiBi and sinks
    (
        Problem(
            90,
            64,
            heads=2,
            causal=True,
            window_left=40,
            dtype="bfloat16",
            softcap=3.0,
            alibi=True,
            sinks=True,
        ),
        {},
    ),  # fmt: skip
]
ALL_CASES = [("mma_f16_bwd", p, params) for p, params in CASES] + [
    ("wgmma_f16_bwd", p, params) for p, params in WGMMA_CASES
]


@pytest.mark.parametrize(
    ("family", "problem", "params"),
    ALL_CASES,
    ids=[f"{family}-{p.label()}" for family, p, _ in ALL_CASES],
)
def test_emulated_backward_matches_float64(
    family: str, problem: Problem, params: dict[str, int]
) -> None:
    forward = plan_kernel(problem, KernelParams("mma_f16", **FORWARD), H200)
    backward_problem = dataclasses.replace(problem, direction="backward")
    backward = plan_kernel(backward_problem, KernelParams(family, **params), H200)
    assert forward.feasible and backward.feasible, (forward.reason, backward.reason)
    run = emulate.emulate_backward(forward, backward)
    sinks = run.sinks if problem.sinks else None
    slopes = run.alibi_slopes if problem.alibi else None
    reference = BackwardReference.compute(
        problem, run.q, run.k, run.v, run.dout.reshape(run.q.shape), slopes, sinks
    )
    sampled = reference.gradients
    forward_limit = precision.FALLBACK_TOLERANCE[problem.dtype]
    forward_check = reference.check_forward(run.out, run.lse, forward_limit)
    assert forward_check.ok, forward_check.detail
    assert reference.full and sampled.heads.size == problem.batch_heads
    result = reference.check(run.gradients)
    assert result.ok, result.detail
    if problem.sinks:
        assert "d_sinks" in result.detail


def test_a_transposed_fragment_fails_the_check_which_says_where() -> None:
    """dK transposed within each 8x8 block (what a missing ``.trans`` on an ldmatrix gives)
    fails the check, whose detail names the gradient and the element."""
    problem = Problem(40, 64, dtype="bfloat16")
    params = {"block_m": 32, "block_n": 64, "warps": 4, "q_chunk": 16}
    forward = plan_kernel(problem, KernelParams("mma_f16", **FORWARD), H200)
    backward = plan_kernel(
        dataclasses.replace(problem, direction="backward"),
        KernelParams("mma_f16_bwd", **params),
        H200,
    )
    run = emulate.emulate_backward(forward, backward)
    reference = BackwardReference.compute(
        problem, run.q, run.k, run.v, run.dout.reshape(run.q.shape)
    )
    assert reference.check(run.gradients).ok
    # dK transposed within each 8x8 block is what a missing .trans would give
    dk = run.gradients["dk"].reshape(-1, 8, 8).transpose(0, 2, 1).reshape(-1)
    broken = reference.check(run.gradients | {"dk": dk})
    assert not broken.ok and "worst dk at [KV head, key, column]" in broken.detail


# ---------------------------------------------------------------------------- the Hopper forward

#: wgmma_f16 plans (tunables, and the SMs the planner sees: a persistent grid of 2 blocks walks
#: several row blocks each); the emulated TMA, mbarriers, named barriers and wgmma
#: (include/fa/hopper.cuh and wgmma_ops.cuh beside the emulator)
WGMMA_FORWARD_CASES = [
    # two consumers, the default plan, causal with kv_len > seq_len, odd lengths
    (Problem(130, 128, causal=True, dtype="bfloat16", kv_len=150), {}, None),
    # FlashAttention-3's intra-warpgroup overlap, ping-pong and the staged store
    (
        Problem(130, 128, heads=2, causal=True, dtype="bfloat16"),
        {"overlap": 1, "pingpong": 1, "staged_store": 1, "stages": 3},
        None,
    ),
    # FlashAttention-3's head_dim 128 tile: 176 keys (11 k16 steps), P packed late into one
    # register set; 400 keys are three tiles, the last ending mid-tile
    (
        Problem(130, 128, heads=2, kv_len=400, dtype="bfloat16"),
        {"block_n": 176, "overlap": 1, "pingpong": 1, "late_pack": 1},
        None,
    ),
    # head_dim 256's: 80 keys (5 k16 steps), late packing, causal with kv_len > seq_len so
    # the first tile is partly masked and the last ends mid-tile, float16
    (
        Problem(70, 256, kv_len=230, causal=True, dtype="float16"),
        {"block_n": 80, "overlap": 1, "late_pack": 1},
        None,
    ),
    # three consumers (FlashAttention-3's 192-row blocks of head_dim 64): the ping-pong's
    # turns round robin over three, late packing, the staged store through its own barriers;
    # causal with kv_len > seq_len, 400 rows end mid-block
    (
        Problem(400, 64, heads=2, kv_len=420, causal=True, dtype="bfloat16"),
        {"consumers": 3, "overlap": 1, "pingpong": 1, "late_pack": 1, "staged_store": 1},
        None,
    ),
    # three consumers walking the persistent queue with the three-way ping-pong: every item's
    # turns complete before the next item's begin (causal items of unequal tile counts)
    (
        Problem(450, 64, heads=2, causal=True, dtype="float16"),
        {"consumers": 3, "block_n": 96, "overlap": 1, "pingpong": 1, "persistent": 1},
        2,
    ),
    # the epilogue by TMA stores (FlashAttention-3's): the staged tile goes out through the
    # output's tensor map, at head_dim 96 (the 64-byte swizzle, three column chunks); 130 rows
    # end mid-block, so the TMA must not write the rows past seq_len (the next head's)
    (
        Problem(130, 96, heads=2, kv_len=200, causal=True, dtype="bfloat16"),
        {"block_n": 96, "overlap": 1, "pingpong": 1, "staged_store": 2},
        None,
    ),
    # the rescale slack (FlashAttention-4's conditional rescaling): rows keep a stale max
    # within 2^8 and skip the output's rescale; with a window, softcap and sinks (the sink
    # joins the denominator against the stale max), GQA, causal with kv_len > seq_len
    (
        Problem(130, 128, heads=4, kv_heads=2, kv_len=300, causal=True, dtype="bfloat16",
                window_left=150, softcap=20.0, sinks=True),
        {"overlap": 1, "pingpong": 1, "late_pack": 1, "rescale_slack": 8},
        None,
    ),
    # TMA stores on the persistent queue: the tile is released (q_empty) only once the TMA
    # has read it, and the next item's Q lands in it
    (
        Problem(330, 128, heads=2, causal=True, dtype="float16"),
        {"overlap": 1, "pingpong": 1, "staged_store": 2, "persistent": 1},
        2,
    ),
    # the persistent queue (heaviest first under causal), one consumer, 64-key tiles, float16
    (
        Problem(200, 64, heads=3, causal=True, dtype="float16"),
        {"consumers": 1, "block_n": 64, "persistent": 1, "overlap": 1},
        2,
    ),
    # head_dim 96 (the 64-byte swizzle), GQA, a KV cache with a window, softcap and sinks
    (
        Problem(
            100,
            96,
            heads=4,
            kv_heads=2,
            kv_len=300,
            causal=True,
            window_left=50,
            softcap=30.0,
            sinks=True,
            dtype="bfloat16",
        ),
        {"consumers": 1, "block_n": 64},
        None,
    ),  # fmt: skip
    # split-KV: a short query over a long cache, partials merged by wgmma_f16_split_merge
    (
        Problem(3, 128, heads=2, kv_len=1000, dtype="bfloat16"),
        {"consumers": 1, "split_target": 2},
        None,
    ),
]


@pytest.mark.parametrize(
    ("problem", "params", "sms"),
    WGMMA_FORWARD_CASES,
    ids=[p.label() for p, _, _ in WGMMA_FORWARD_CASES],
)
def test_emulated_wgmma_forward_matches_float64(
    problem: Problem, params: dict[str, int], sms: int | None
) -> None:
    device = H200 if sms is None else dataclasses.replace(H200, sm_count=sms)
    plan = plan_kernel(problem, KernelParams("wgmma_f16", **params), device)
    assert plan.feasible or "larger than needed" in plan.reason, plan.reason
    if "split_target" in params:
        assert plan.sequence_splits > 1
    if params.get("persistent"):
        assert plan.launch.grid[0] < problem.batch_heads * -(-problem.seq_len // 64)
    run = emulate.emulate_forward(plan)
    reference = BackwardReference.compute(
        problem,
        run.q,
        run.k,
        run.v,
        np.zeros(run.q.shape, dtype=np.float32),
        run.alibi_slopes if problem.alibi else None,
        run.sinks if problem.sinks else None,
    )
    checked = reference.check_forward(run.out, run.lse, precision.FALLBACK_TOLERANCE[problem.dtype])
    assert checked.ok, checked.detail


# ---------------------------------------------------------------------------- decode

#: decode_f16 plans: a KV head's query rows packed into one m16 tile, its cache split
DECODE_CASES = [
    # GQA decode (4 query heads a KV head), bf16, a cache that ends mid-tile, 3 splits
    (Problem(1, 128, batch=2, heads=8, kv_heads=2, kv_len=300, dtype="bfloat16"), {"splits": 3}),
    # a few query rows (speculative decoding), causal, float16, sinks, two m tiles
    (
        Problem(3, 64, heads=8, kv_heads=1, kv_len=200, causal=True, sinks=True, dtype="float16"),
        {"splits": 2, "m_tiles": 2, "block_n": 32, "warps": 2},
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    ("problem", "params"), DECODE_CASES, ids=[p.label() for p, _ in DECODE_CASES]
)
def test_emulated_decode_matches_float64(problem: Problem, params: dict[str, int]) -> None:
    plan = plan_kernel(problem, KernelParams("decode_f16", **params), H200)
    assert plan.feasible, plan.reason
    assert plan.sequence_splits == params["splits"]
    run = emulate.emulate_forward(plan)
    reference = BackwardReference.compute(
        problem, run.q, run.k, run.v, np.zeros(run.q.shape, dtype=np.float32), None,
        run.sinks if problem.sinks else None,
    )  # fmt: skip
    checked = reference.check_forward(run.out, run.lse, precision.FALLBACK_TOLERANCE[problem.dtype])
    assert checked.ok, checked.detail
