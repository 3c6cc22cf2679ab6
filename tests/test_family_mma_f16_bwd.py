"""The mma_f16_bwd family and the backward span it plans with: which query blocks each key
tile visits (property-tested against the mask, pair by pair), the deterministic order's
start, feasibility with reasons, the kernel's layout contract, the launches and their
argument types against the kernel's signatures, and the cost terms (2.5x the forward's
flops). Pure: no GPU, no compiler."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_launch_config import kernel_signatures

from kernels import build
from tuner.costmodel import predict
from tuner.device import H200
from tuner.planner.backward_span import (
    first_visiting_tile,
    key_tiles,
    query_blocks,
    visited_blocks_per_kv_head,
    visiting_query_blocks,
)
from tuner.planner.families import families_for, family_named
from tuner.planner.families.backward_base import padded_rows
from tuner.planner.families.mma_f16_bwd import (
    dq_tiles,
    mma_f16_bwd_registers,
    mma_f16_bwd_shared_bytes,
)
from tuner.planner.launches import BackwardBuffers, DeviceBuffers
from tuner.planner.params import KernelParams
from tuner.planner.space import candidate_space
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem

FAMILY = family_named("mma_f16_bwd")
BACKWARD = Problem(4096, 128, batch=4, heads=16, dtype="bfloat16", direction="backward")
MARKERS = BackwardBuffers(*(1000 + 16 * i for i in range(17)))


def plan(problem: Problem = BACKWARD, **tunables: int):
    return plan_kernel(problem, KernelParams("mma_f16_bwd", **tunables), H200)


def visible(problem: Problem, row: int, key: int) -> bool:
    low, high = problem.visible_offsets
    return (low is None or key >= row + low) and (high is None or key <= row + high)


problems = st.builds(
    lambda n, extra, causal, left, right, dtype: Problem(
        n, 64, causal=causal, kv_len=n + extra if causal else max(1, n + extra - 30),
        window_left=left, window_right=right, dtype=dtype, direction="backward",
    ),
    st.integers(1, 90), st.integers(0, 60), st.booleans(), st.integers(-1, 70),
    st.integers(-1, 70), st.sampled_from(("bfloat16", "float16")),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(problems, st.sampled_from((16, 32, 64)), st.sampled_from((16, 32, 64)))
def test_key_tiles_visit_exactly_the_query_blocks_that_see_them(
    problem: Problem, block_m: int, block_n: int
) -> None:
    begin, end = visiting_query_blocks(problem, block_m, block_n)
    assert begin.size == key_tiles(problem, block_n)
    for n in range(begin.size):
        keys = range(n * block_n, min((n + 1) * block_n, problem.kv_len))
        for m in range(query_blocks(problem, block_m)):
            rows = range(m * block_m, min((m + 1) * block_m, problem.seq_len))
            sees = any(visible(problem, r, k) for r in rows for k in keys)
            assert (begin[n] <= m < end[n]) == sees, (n, m)
    assert visited_blocks_per_kv_head(problem, block_m, block_n) == int((end - begin).sum())


@settings(max_examples=300, deadline=None)
@given(problems, st.sampled_from((16, 32, 64)), st.sampled_from((16, 32, 64)))
def test_the_tiles_visiting_a_query_block_are_one_run_from_the_deterministic_start(
    problem: Problem, block_m: int, block_n: int
) -> None:
    """Deterministic dQ lets tile n add to block m after ``n - first`` tiles: the visitors of m
    must be the tiles first, first + 1, ... with no gap, or a turn never comes."""
    begin, end = visiting_query_blocks(problem, block_m, block_n)
    for m in range(query_blocks(problem, block_m)):
        visitors = [n for n in range(begin.size) if begin[n] <= m < end[n]]
        if visitors:
            first = first_visiting_tile(problem, m, block_m, block_n)
            assert visitors == list(range(first, first + len(visitors))), m


def test_it_plans_backward_problems_of_the_half_dtypes_only() -> None:
    assert families_for("bfloat16", "backward") == ("mma_f16_bwd", "wgmma_f16_bwd")
    assert "mma_f16_bwd" not in families_for("bfloat16")
    assert families_for("float32", "backward") == ()
    forward = dataclasses.replace(BACKWARD, direction="forward")
    assert plan(forward).reason == "mma_f16_bwd computes the backward pass, not the forward pass"
    refused = plan_kernel(BACKWARD, KernelParams("mma_f16"), H200)
    assert refused.reason == "mma_f16 computes the forward pass, not the backward pass"
    backward_families = {p.family for p in candidate_space(BACKWARD, H200).feasible}
    assert backward_families == {"mma_f16_bwd", "wgmma_f16_bwd"}
    assert "mma_f16_bwd" not in {p.family for p in candidate_space(forward, H200).feasible}


def test_shared_bytes_and_grid_follow_the_kernels_layout() -> None:
    # K, V (136-element rows), dS^T (72-element rows), two stages of Q, dO, then float rows
    bytes_ = 2 * (2 * 128 * 136 + 128 * 72 + 2 * 2 * 64 * 136) + 4 * 2 * 2 * 64
    assert mma_f16_bwd_shared_bytes(64, 128, 2, 128) == bytes_ == 158720
    p = plan(block_m=64, block_n=128, warps=8, stages=2)
    assert p.feasible and p.launch.shared_bytes == bytes_
    assert p.launch.grid == (32, 1, 64) and p.launch.block == (256, 1, 1)
    gqa = Problem(4096, 128, batch=2, heads=32, kv_heads=8, dtype="bfloat16", direction="backward")
    assert plan(gqa, group_split=2).launch.grid == (32, 2, 16)


@pytest.mark.parametrize(
    ("tunables", "problem", "words"),
    [
        ({"block_n": 128, "warps": 4}, BACKWARD, "registers a thread"),  # 32 keys x 128
        ({"block_n": 64, "warps": 8}, BACKWARD, "is not 16 or 32 keys a warp"),
        ({"block_m": 32, "q_chunk": 64}, BACKWARD, "q_chunk=64 is not 16 or 32"),
        ({"stages": 3}, BACKWARD, "single (1) or double (2)"),
        ({"group_split": 2}, BACKWARD, "does not divide the 1 query heads"),
        ({"block_m": 128, "stages": 2}, BACKWARD, "opt-in limit"),
        ({}, dataclasses.replace(BACKWARD, head_dim=256), "up to 128"),
        ({}, Problem(64, 72, dtype="float16", direction="backward"), "multiple of 16"),
        ({"block_m": 128}, Problem(40, 64, dtype="bfloat16", direction="backward"), "larger"),
    ],
)
def test_infeasible_plans_say_why_in_one_line(tunables, problem, words) -> None:
    p = plan(problem, **tunables)
    assert not p.feasible and words in p.reason and "\n" not in p.reason


def test_the_register_estimate_tracks_ptxas() -> None:
    # nvcc 13.0 sm_90: 237, 245, 238, 148 registers, no spills; 255 + spills at 32 keys x 64 x 32
    assert abs(mma_f16_bwd_registers(16, 128, 16) - 237) <= 16
    assert abs(mma_f16_bwd_registers(16, 128, 32) - 245) <= 16
    assert abs(mma_f16_bwd_registers(32, 64, 16) - 238) <= 16
    assert mma_f16_bwd_registers(32, 64, 32) > 255


def test_dq_units_give_every_warp_work() -> None:
    # the kernel's dq_tiles(): head_dim/8 n8 tiles, block_m/16 m tiles, one unit a warp at least
    assert dq_tiles(128, 64, 8) == 8 and dq_tiles(64, 64, 8) == 4 and dq_tiles(64, 32, 8) == 2
    for head_dim, block_m, warps in ((128, 64, 8), (64, 64, 8), (128, 32, 8), (64, 128, 4)):
        units = block_m // 16 * (head_dim // 8 // dq_tiles(head_dim, block_m, warps))
        assert units >= warps


@pytest.mark.parametrize("deterministic", [0, 1])
@pytest.mark.parametrize(
    "problem",
    [
        BACKWARD,
        Problem(77, 64, heads=4, kv_heads=1, causal=True, dtype="float16", kv_len=100,
                direction="backward", sinks=True, softcap=30.0),
    ],
)  # fmt: skip
def test_launches_carry_the_plans_buffers_in_the_kernels_signatures(problem, deterministic):
    split = 2 if problem.group > 1 else 1
    p = plan(problem, block_m=32, block_n=64, warps=4, deterministic=deterministic,
             group_split=split)  # fmt: skip
    assert p.feasible, p.reason
    launches = FAMILY.launches(p, MARKERS)
    names = [launch.function for launch in launches]
    expected = ["mma_f16_bwd_preprocess", "mma_f16_bwd_attention", "mma_f16_bwd_dq"]
    expected += ["mma_f16_bwd_dkv"] * (split > 1) + ["mma_f16_bwd_sinks"] * problem.sinks
    assert names == expected and set(names) <= set(build.ENTRY_FUNCTIONS["mma_f16_bwd"])
    signatures = kernel_signatures()
    for launch in launches:
        assert [type(a) for a in launch.args] == signatures[launch.function], launch.function
    pre, main, dq = launches[:3]
    rows = problem.batch_heads * padded_rows(problem.seq_len, 32)
    assert pre.grid[0] * 4 >= rows and pre.block == (128, 1, 1)
    assert pre.args[6] == (MARKERS.counters if deterministic else 0)
    assert main.grid == p.launch.grid and main.shared_bytes == p.launch.shared_bytes
    assert main.args[9] == (MARKERS.dkv_partial if split > 1 else 0)
    assert main.args[10] == (MARKERS.counters if deterministic else 0)
    assert (main.args[11], main.args[12], main.args[13]) == (
        problem.seq_len, problem.kv_len, problem.group
    )  # fmt: skip
    assert dq.grid[0] * 128 * 4 >= problem.batch_heads * problem.seq_len * problem.head_dim
    assert dq.args[3] == np.float32(1 / np.sqrt(problem.head_dim))
    with pytest.raises(TypeError, match="BackwardBuffers"):
        FAMILY.launches(p, DeviceBuffers(1, 2, 3, 4))


def test_scratch_is_what_the_kernels_index() -> None:
    gqa = Problem(100, 64, batch=2, heads=8, kv_heads=2, kv_len=130, dtype="bfloat16",
                  direction="backward")  # fmt: skip
    scratch = FAMILY.backward_scratch(plan(gqa, block_m=64, deterministic=1, group_split=4))
    rows = 2 * 8 * 128  # 100 rows padded to two 64-row blocks
    assert (scratch.lse_log2, scratch.delta) == (4 * rows, 4 * rows)
    assert scratch.dq_accum == 4 * 2 * 8 * 100 * 64
    assert scratch.counters == 4 * rows // 64
    assert scratch.dkv_partial == 4 * 2 * 2 * 2 * 4 * 130 * 64
    plain = FAMILY.backward_scratch(plan(gqa, block_m=64))
    assert plain.counters == 0 and plain.dkv_partial == 0


def test_cost_terms_count_five_products_a_pair() -> None:
    p = plan(block_m=64, block_n=128, warps=8)
    terms = FAMILY.cost_terms(p)
    assert terms.matmuls_per_pair == 5
    # non-causal: every key tile visits every query block
    assert terms.executed_pairs == 4096 * 4096
    assert BACKWARD.useful_flops == 10 * 64 * 4096 * 4096 * 128
    forward = dataclasses.replace(BACKWARD, direction="forward")
    assert BACKWARD.useful_flops == 5 * forward.useful_flops // 2
    assert predict(p, H200).executed_flops == BACKWARD.useful_flops
    causal = dataclasses.replace(BACKWARD, causal=True)
    half = FAMILY.cost_terms(plan(causal, block_m=64, block_n=128, warps=8)).executed_pairs
    assert 0.5 < half / terms.executed_pairs < 0.53  # the diagonal's blocks, whole
    assert predict(plan(deterministic=1), H200).time_ms > predict(p, H200).time_ms
