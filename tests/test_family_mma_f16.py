"""The mma_f16 family's planning module: feasibility, partition, traffic, launches, cost terms.

Pure: no GPU, no compiler. The kernel's layout contract (shared bytes, grid,
split span a multiple of the key tile) is checked against the numbers the
kernel's header states.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.device import H200
from tuner.planner.families import families_for, family_named
from tuner.planner.families.mma_f16 import mma_f16_shared_bytes
from tuner.planner.params import KernelParams
from tuner.planner.space import candidate_space
from tuner.problem import Problem

FAMILY = family_named("mma_f16")
BF16 = Problem(4096, 128, batch=4, heads=16, dtype="bfloat16")


def plan(problem: Problem = BF16, **tunables: int):
    return FAMILY.plan(problem, KernelParams("mma_f16", **tunables), H200)


def test_it_takes_the_half_dtypes_only() -> None:
    assert "mma_f16" in families_for("bfloat16") and "mma_f16" in families_for("float16")
    assert "mma_f16" not in families_for("float32")
    assert plan(Problem(64, 64)).reason == "dtype float32 is not one of bfloat16, float16"


def test_shared_bytes_follow_the_kernels_layout() -> None:
    # rows of head_dim + 8 two-byte elements: Q's block and `stages` (K, V) pairs
    assert mma_f16_shared_bytes(128, 64, 2, 128) == 2 * 136 * (128 + 2 * 2 * 64) == 104448
    p = plan(block_m=128, block_n=64, warps=4, stages=2)
    assert p.feasible and p.launch.shared_bytes == 104448
    assert p.launch.block == (128, 1, 1) and p.launch.grid == (32, 1, 64)
    # 128 x 128 x 3 stages: 243712 B, over the H200's 232448 B opt-in limit
    over = plan(block_m=128, block_n=128, warps=8, stages=3)
    assert not over.feasible and "232448" in over.reason and "243712" in over.reason


@pytest.mark.parametrize(
    ("tunables", "problem", "words"),
    [
        ({"block_m": 64, "warps": 8}, BF16, "is not 16 or 32 rows a warp"),
        ({"block_m": 256, "warps": 4}, BF16, "is not 16 or 32 rows a warp"),
        ({"block_m": 128, "warps": 8, "s_groups": 2}, BF16, "does not divide the 1 m16"),
        ({"block_n": 40}, BF16, "block_n=40 is not a multiple of 16"),
        ({"stages": 1}, BF16, "needs at least 2"),
        ({}, Problem(64, 72, dtype="float16"), "head_dim=72 is not a multiple of 16"),
        ({}, Problem(64, 512, dtype="float16"), "up to 256"),
        ({"block_m": 256, "warps": 8}, Problem(100, 64, dtype="bfloat16"), "larger than needed"),
    ],
)
def test_infeasible_plans_say_why_in_one_line(tunables, problem, words) -> None:
    p = plan(problem, **tunables)
    assert not p.feasible and words in p.reason and "\n" not in p.reason


def test_the_split_partition_is_the_seeds_with_the_key_tile() -> None:
    # 4096 keys in 64-key tiles: 64 tiles, 4 tiles a split -> 16 splits of 256 keys
    p = plan(Problem(4096, 128, dtype="bfloat16"), block_n=64, split_target=4)
    assert (p.tile_count, p.sequence_splits, p.keys_per_sequence_split) == (64, 16, 256)
    assert p.launch.grid[1] == 16 and p.reduce_launch is not None
    assert p.reduce_launch.block == (128, 1, 1)
    assert p.reduce_launch.grid[0] * 128 * 4 >= 4096 * 128
    alone = plan(Problem(4096, 128, dtype="bfloat16"), block_n=64, split_target=1 << 16)
    assert alone.sequence_splits == 1 and alone.reduce_launch is None


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 20000),
    block_n=st.sampled_from((32, 48, 64, 128)),
    target=st.sampled_from(tuple(2**k for k in range(17))),
)
def test_splits_cover_every_key_once_in_whole_tiles(n: int, block_n: int, target: int) -> None:
    p = plan(Problem(n, 64, dtype="bfloat16"), block_n=block_n, split_target=target)
    span = p.keys_per_sequence_split
    assert span % block_n == 0
    assert (p.sequence_splits - 1) * span < n <= p.sequence_splits * span


def test_traffic_counts_two_byte_elements_and_float32_scratch() -> None:
    full = plan(block_m=128, split_target=1 << 16)
    n, d, bh = 4096, 128, 64
    # Q read once, K and V once per 128-row block, O written once; 2 bytes each
    assert full.global_read_bytes == 2 * bh * (n * d + 2 * 32 * n * d)
    assert full.global_write_bytes == 2 * bh * n * d
    split = plan(block_m=128, block_n=64, split_target=16)
    scratch = 4 * bh * split.sequence_splits * n * (d + 1)  # partial O + one lse a row
    assert split.global_read_bytes == full.global_read_bytes + scratch
    assert split.partial_elements == bh * split.sequence_splits * n * (d + 1)


def test_causal_plans_read_fewer_keys_and_count_half_the_pairs() -> None:
    causal = Problem(4096, 128, batch=4, heads=16, causal=True, dtype="bfloat16")
    assert plan(causal).global_read_bytes < plan().global_read_bytes
    assert plan(causal).matmul_flops == causal.useful_flops < BF16.useful_flops


def test_defines_and_key_name_every_tunable() -> None:
    p = plan(
        Problem(1000, 96, causal=True, dtype="float16"),
        block_m=256, block_n=48, warps=8, stages=3, q_in_registers=0, s_groups=2,
        split_target=4,
    )
    assert FAMILY.compile_defines(p) == {
        "HEAD_DIM": 96, "BLOCK_M": 256, "BLOCK_N": 48, "WARPS": 8, "STAGES": 3,
        "CAUSAL": 1, "IS_FP16": 1, "Q_IN_REGISTERS": 0, "S_GROUPS": 2,
    }
    assert p.key() == f"mma_f16/m256/n48/w8/st3/qsmem/g2/s{p.sequence_splits}"


def test_distinct_plans_have_distinct_keys_and_the_space_is_not_empty() -> None:
    for n, d, causal in itertools.product((1, 7, 1000, 4096), (64, 96, 128, 256), (False, True)):
        space = candidate_space(Problem(n, d, causal=causal, dtype="bfloat16"), H200)
        assert space.feasible, (n, d, causal)
        keys = [p.key() for p in space.feasible]
        assert len(keys) == len(set(keys))
        # decode_f16 joins for the few-row queries it serves
        assert "mma_f16" in {p.family for p in space.feasible}
        assert {p.family for p in space.feasible} <= set(families_for("bfloat16"))


def test_cost_terms_charge_the_extra_k_reads_of_two_s_groups() -> None:
    one = FAMILY.cost_terms(plan(block_m=256, warps=8, s_groups=1))
    two = FAMILY.cost_terms(plan(block_m=256, warps=8, s_groups=2))
    assert one.matmul_pipe == two.matmul_pipe == "mma_sync_f16"
    assert two.shared_bytes > one.shared_bytes and two.shared_lane_ops > one.shared_lane_ops
    assert two.ilp < one.ilp and one.executed_pairs == two.executed_pairs
    smem = FAMILY.cost_terms(plan(q_in_registers=0))
    regs = FAMILY.cost_terms(plan(q_in_registers=1))
    assert smem.shared_bytes > regs.shared_bytes
