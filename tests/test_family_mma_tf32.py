"""The mma_tf32 family's planning module: precision, feasibility, partition, traffic, cost terms.

Pure: no GPU, no compiler. The kernel's layout contract (shared bytes, grid,
split span a multiple of the key tile) is checked against the numbers the
kernel's header states.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.costmodel import matmul_rate, predict
from tuner.device import H200
from tuner.planner.families import families_for, family_named
from tuner.planner.families.mma_tf32 import mma_tf32_shared_bytes, passes_allowed
from tuner.planner.params import KernelParams
from tuner.planner.space import candidate_space
from tuner.problem import Problem

FAMILY = family_named("mma_tf32")
ACCURATE = Problem(4096, 128, batch=4, heads=16)
FAST = Problem(4096, 128, batch=4, heads=16, precision="tf32")


def plan(problem: Problem = ACCURATE, **tunables: int):
    return FAMILY.plan(problem, KernelParams("mma_tf32", **tunables), H200)


def test_it_takes_float32_beside_the_simt_families() -> None:
    assert families_for("float32") == ("scalar_online", "tiled", "mma_tf32")
    assert "mma_tf32" not in families_for("bfloat16")
    assert plan(Problem(64, 64, dtype="bfloat16")).reason == "dtype bfloat16 is not one of float32"


def test_the_precision_decides_the_passes() -> None:
    assert passes_allowed(ACCURATE) == (3,) and passes_allowed(FAST) == (3, 1)
    refused = plan(ACCURATE, passes=1)
    assert not refused.feasible
    assert refused.reason == (
        "passes=1 (one TF32 product) is less precise than precision=tf32x3 allows"
    )
    assert plan(FAST, passes=1).feasible and plan(FAST, passes=3).feasible
    assert plan(ACCURATE, passes=3).feasible
    assert "is not one of 3, 1" in plan(FAST, passes=2).reason


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_the_space_holds_exactly_the_admitted_passes(precision: str) -> None:
    problem = Problem(1000, 128, heads=16, precision=precision)
    space = candidate_space(problem, H200)
    passes = {p.params.passes for p in space.feasible if p.family == "mma_tf32"}
    assert passes == set(passes_allowed(problem))
    families = {p.family for p in space.feasible}
    assert families == {"scalar_online", "tiled", "mma_tf32"}  # SIMT and tensor cores together


def test_shared_bytes_follow_the_kernels_layout() -> None:
    # rows of head_dim + 4 floats: Q's block and `stages` (K, V) pairs
    assert mma_tf32_shared_bytes(64, 64, 2, 128) == 4 * 132 * (64 + 2 * 2 * 64) == 168960
    p = plan(block_m=64, block_n=64, warps=4, stages=2)
    assert p.feasible and p.launch.shared_bytes == 168960
    assert p.launch.block == (128, 1, 1) and p.launch.grid == (64, 1, 64)
    # 128 x 64 x 3 stages: 4 * 132 * (128 + 384) = 270336 B, over the 232448 B opt-in limit
    over = plan(block_m=128, block_n=64, warps=8, stages=3)
    assert not over.feasible and "232448" in over.reason and "270336" in over.reason


@pytest.mark.parametrize(
    ("tunables", "problem", "words"),
    [
        ({"block_m": 64, "warps": 8}, ACCURATE, "is not 16 or 32 rows a warp"),
        ({"block_m": 128, "warps": 2}, ACCURATE, "is not 16 or 32 rows a warp"),
        ({"block_n": 40}, ACCURATE, "block_n=40 is not a multiple of 16"),
        ({"stages": 1}, ACCURATE, "needs at least 2"),
        ({}, Problem(64, 36), "head_dim=36 is not a multiple of 8"),
        ({}, Problem(64, 264), "up to 256"),
        ({"block_m": 64, "warps": 2}, ACCURATE, "accumulator floats a thread"),
        ({"block_m": 128, "warps": 8}, Problem(40, 64), "larger than needed"),
        ({"block_m": 32, "warps": 2, "block_n": 64}, Problem(20, 64), "block_n=64 is larger"),
    ],
)
def test_infeasible_plans_say_why_in_one_line(tunables, problem, words) -> None:
    p = plan(problem, **tunables)
    assert not p.feasible and words in p.reason and "\n" not in p.reason


def test_the_register_screen_matches_ptxas_on_the_measured_corners() -> None:
    # ptxas -v, sm_90: 16 rows a warp at head_dim 256 x block_n 32 (144 accumulator
    # floats) takes 248 registers without spills; 32 rows a warp at 128 x 64 spills.
    assert plan(Problem(1000, 256), block_m=64, warps=4, block_n=32).feasible
    assert not plan(Problem(1000, 128), block_m=64, warps=2, block_n=64).feasible
    assert not plan(Problem(1000, 256), block_m=64, warps=4, block_n=64).feasible


def test_the_split_partition_is_the_seeds_with_the_key_tile() -> None:
    p = plan(Problem(4096, 128), block_n=64, split_target=4)
    assert (p.tile_count, p.sequence_splits, p.keys_per_sequence_split) == (64, 16, 256)
    assert p.launch.grid[1] == 16 and p.reduce_launch is not None
    assert p.reduce_launch.grid[0] * 128 * 4 >= 4096 * 128
    alone = plan(Problem(4096, 128), block_n=64, split_target=1 << 16)
    assert alone.sequence_splits == 1 and alone.reduce_launch is None


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 40000),
    block_n=st.sampled_from((32, 64)),
    target=st.sampled_from(tuple(2**k for k in range(17))),
)
def test_splits_cover_every_key_once_in_whole_tiles(n: int, block_n: int, target: int) -> None:
    p = plan(Problem(n, 64), block_n=block_n, split_target=target)
    span = p.keys_per_sequence_split
    assert span % block_n == 0
    assert (p.sequence_splits - 1) * span < n <= p.sequence_splits * span


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 5000),
    d=st.sampled_from((32, 64, 96, 128)),
    causal=st.booleans(),
    precision=st.sampled_from(("tf32x3", "tf32")),
)
def test_every_problem_has_a_feasible_plan_of_each_admitted_pass(
    n: int, d: int, causal: bool, precision: str
) -> None:
    problem = Problem(n, d, causal=causal, precision=precision)
    feasible = [
        p
        for params in FAMILY.enumerate_params(problem, {})
        if (p := FAMILY.plan(problem, params, H200)).feasible
    ]
    assert {p.params.passes for p in feasible} == set(passes_allowed(problem))
    for p in feasible:
        assert p.launch.shared_bytes <= H200.max_shared_memory_per_block_optin
        assert p.params.block_m // p.params.warps in (16, 32)


def test_traffic_counts_four_byte_elements_and_float32_scratch() -> None:
    full = plan(block_m=64, split_target=1 << 16)
    n, d, bh = 4096, 128, 64
    # Q read once, K and V once per 64-row block, O written once; 4 bytes each
    assert full.global_read_bytes == 4 * bh * (n * d + 2 * 64 * n * d)
    assert full.global_write_bytes == 4 * bh * n * d
    split = plan(block_m=64, block_n=64, split_target=16)
    scratch = 4 * bh * split.sequence_splits * n * (d + 1)
    assert split.global_read_bytes == full.global_read_bytes + scratch
    assert split.partial_elements == bh * split.sequence_splits * n * (d + 1)


def test_causal_plans_read_fewer_keys_and_count_half_the_pairs() -> None:
    causal = Problem(4096, 128, batch=4, heads=16, causal=True)
    assert plan(causal).global_read_bytes < plan().global_read_bytes
    assert plan(causal).matmul_flops == causal.useful_flops < ACCURATE.useful_flops


def test_defines_and_key_name_every_tunable() -> None:
    p = plan(
        Problem(1000, 96, causal=True, precision="tf32"),
        block_m=128, block_n=32, warps=8, stages=3, passes=1, split_target=4,
    )
    assert FAMILY.compile_defines(p) == {
        "HEAD_DIM": 96, "BLOCK_M": 128, "BLOCK_N": 32, "WARPS": 8, "STAGES": 3,
        "CAUSAL": 1, "PASSES": 1,
    }
    assert p.key() == f"mma_tf32/x1/m128/n32/w8/st3/s{p.sequence_splits}"


def test_distinct_plans_have_distinct_keys_and_the_space_is_not_empty() -> None:
    for n, d, causal in itertools.product((1, 7, 1000), (32, 64, 128), (False, True)):
        space = candidate_space(Problem(n, d, causal=causal, precision="tf32"), H200)
        tf32 = [p for p in space.feasible if p.family == "mma_tf32"]
        assert tf32, (n, d, causal)
        keys = [p.key() for p in space.feasible]
        assert len(keys) == len(set(keys))


def test_three_passes_cost_three_times_the_tensor_core_work() -> None:
    one = FAMILY.cost_terms(plan(FAST, passes=1))
    three = FAMILY.cost_terms(plan(FAST, passes=3))
    assert one.matmul_pipe == three.matmul_pipe == "mma_sync_tf32"
    assert (one.matmul_passes, three.matmul_passes) == (1, 3)
    assert one.executed_pairs == three.executed_pairs
    assert three.shared_lane_ops > one.shared_lane_ops  # the lo halves' splits
    # half the bf16/fp16 rate per flop
    assert matmul_rate("mma_sync_tf32", H200) == matmul_rate("mma_sync_f16", H200) / 2
    fast, accurate = predict(plan(FAST, passes=1), H200), predict(plan(FAST, passes=3), H200)
    assert fast.compute_ms < accurate.compute_ms < 3.5 * fast.compute_ms
