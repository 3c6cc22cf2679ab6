"""The tunable planner: the seed's partition as a special case, and honest verdicts."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.device import H200
from tuner.planner import (
    KernelParams,
    PlanError,
    ResourceUsage,
    candidate_space,
    plan_flash_attention_tiled,
    plan_kernel,
)
from tuner.planner.families.base import key_rows_read_per_head
from tuner.planner.tunable import (
    choose_threads_per_row,
    tiled_shared_bytes,
)
from tuner.problem import Problem

PARTITION_FIELDS = (
    "tile_size",
    "tile_count",
    "sequence_splits",
    "tiles_per_sequence_split",
    "keys_per_sequence_split",
    "split_reduce_scratch_elements",
    "parallel_workgroups_per_row",
    "rows_per_block",
)


def tiled(n: int, d: int, *, tile: int = 64, rows: int = 64, threads: int = 256, target: int = 4,
          causal: bool = False, batch: int = 1, heads: int = 1):
    problem = Problem(seq_len=n, head_dim=d, batch=batch, heads=heads, causal=causal)
    params = KernelParams("tiled", threads=threads, tile_size=tile, rows_per_block=rows,
                          split_target=target)
    return plan_kernel(problem, params, H200)


@given(
    n=st.integers(1, 200_000),
    d=st.sampled_from([4, 8, 32, 64, 96, 128, 256]),
    tile=st.sampled_from([1, 2, 4, 16, 32, 64, 128, 1000]),
)
@settings(max_examples=300, deadline=None)
def test_partition_equals_the_seeds_at_one_row_per_block_and_target_four(n, d, tile):
    seed = plan_flash_attention_tiled(n, d, tile)
    plan = tiled(n, d, tile=tile, rows=1, threads=32, target=4)
    for name in PARTITION_FIELDS:
        assert getattr(plan, name) == getattr(seed, name), name


def test_seed_numbers_reappear_for_4096_by_128():
    plan = tiled(4096, 128, tile=128, rows=1, threads=32)
    assert (plan.tile_count, plan.sequence_splits, plan.tiles_per_sequence_split) == (32, 8, 4)
    assert plan.keys_per_sequence_split == 512
    assert plan.split_reduce_scratch_elements == 8 * 130


@pytest.mark.parametrize("target, splits", [(1, 64), (4, 16), (16, 4), (64, 1), (65536, 1)])
def test_split_target_is_the_tunable_that_sets_the_split_count(target, splits):
    plan = tiled(4096, 128, tile=64, target=target)
    assert plan.sequence_splits == splits
    assert plan.launch.grid == (4096 // 64, splits, 1)
    assert (plan.reduce_launch is None) == (splits == 1)


def test_launch_describes_the_kernel():
    plan = tiled(1000, 96, tile=32, rows=64, threads=128, target=8, batch=2, heads=3)
    assert plan.feasible, plan.reason
    assert plan.launch.grid == (math.ceil(1000 / 64), plan.sequence_splits, 6)
    assert plan.launch.block == (128, 1, 1)
    assert plan.launch.shared_bytes == tiled_shared_bytes(64, 32, 96)
    # Q, K, V tiles of (rows + 2 tiles) padded rows plus the padded P tile, in floats.
    assert plan.launch.shared_bytes == 4 * ((64 + 2 * 32) * 100 + 64 * 36)
    lanes = plan.threads_per_row
    assert 128 % lanes == 0 and 32 % lanes == 0 and 96 % (4 * lanes) == 0
    assert plan.rows_per_thread == 64 * lanes // 128
    assert plan.compile_defines()["THREADS_PER_ROW"] == lanes


def test_rows_per_block_buys_reuse_of_k_and_v():
    small = tiled(4096, 128, rows=16, target=65536)
    large = tiled(4096, 128, rows=128, target=65536)
    qo = 2 * 4096 * 128 * 4
    assert small.global_read_bytes + small.global_write_bytes - qo == 2 * 4096 * 128 * 4 * 256
    assert large.global_read_bytes + large.global_write_bytes - qo == 2 * 4096 * 128 * 4 * 32


def test_causal_halves_the_work_and_the_traffic():
    full = tiled(4096, 128, rows=64, target=65536)
    causal = tiled(4096, 128, rows=64, target=65536, causal=True)
    assert causal.matmul_flops == 4 * 128 * 4096 * 4097 // 2
    assert full.matmul_flops == 4 * 128 * 4096 * 4096
    kv_full = full.global_read_bytes - 4096 * 128 * 4
    kv_causal = causal.global_read_bytes - 4096 * 128 * 4
    assert kv_causal / kv_full == pytest.approx(0.5, abs=0.01)


@given(n=st.integers(1, 5000), rows=st.sampled_from([1, 3, 16, 64, 128]))
def test_causal_key_rows_closed_form(n, rows):
    blocks = -(-n // rows)
    assert key_rows_read_per_head(n, rows, True) == sum(
        min(n, (b + 1) * rows) for b in range(blocks)
    )


def test_splits_add_the_partial_round_trip_to_traffic():
    one = tiled(4096, 128, target=65536)
    many = tiled(4096, 128, target=4)
    # 16 splits x 4096 rows x (128 accumulators + one log2-sum-exp) float32s
    partial = 16 * 4096 * 129 * 4
    assert many.global_read_bytes - one.global_read_bytes == partial
    assert many.global_write_bytes - one.global_write_bytes == partial


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(threads=2048), "exceeds the 1024-thread block limit"),
        (dict(threads=1024, rows=16, tile=16), "no thread layout"),
        (dict(threads=100), "not a positive multiple of 32"),
        (dict(tile=512, rows=128), "shared memory"),
        (dict(n=40, tile=128), "tile_size=128 is larger than needed for kv_len=40"),
        (dict(n=40, rows=128), "rows_per_block=128 is larger than needed"),
        (dict(d=130), "not a multiple of 4"),
        (dict(tile=6), "tile_size=6 is not a multiple of 4"),
    ],
)
def test_infeasible_candidates_carry_a_one_line_reason(kwargs, fragment):
    n = kwargs.pop("n", 4096)
    d = kwargs.pop("d", 128)
    plan = tiled(n, d, **kwargs)
    assert not plan.feasible
    assert fragment in plan.reason
    assert "\n" not in plan.reason


def test_shared_memory_limit_is_the_devices_opt_in_limit():
    plan = tiled(4096, 128, tile=64, rows=128, threads=256)
    assert plan.launch.shared_bytes <= H200.max_shared_memory_per_block_optin
    tight = replace(H200, max_shared_memory_per_block_optin=plan.launch.shared_bytes - 1)
    judged = plan_kernel(plan.problem, plan.params, tight)
    assert not judged.feasible and "opt-in limit" in judged.reason


def test_compiler_report_can_make_a_plan_infeasible():
    plan = tiled(4096, 128)
    assert plan.feasible
    spilled = plan.with_resources(ResourceUsage(registers=255, spill_store_bytes=64), H200)
    assert not spilled.feasible and "spills" in spilled.reason
    too_many = plan.with_resources(ResourceUsage(registers=255), H200)
    assert too_many.feasible  # 256 regs x 256 threads = the whole file, still fits
    big_block = tiled(4096, 128, threads=512)
    judged = big_block.with_resources(ResourceUsage(registers=200), H200)
    assert not judged.feasible and "register" in judged.reason
    fine = plan.with_resources(ResourceUsage(registers=64), H200)
    assert fine.feasible and fine.blocks_per_sm == plan.blocks_per_sm


def test_occupancy_and_waves_follow_the_device():
    plan = tiled(4096, 128, tile=32, rows=32, threads=128, target=65536, batch=4, heads=16)
    assert plan.feasible
    per_block = plan.launch.shared_bytes + H200.reserved_shared_memory_per_block
    expected_blocks = min(32, 2048 // 128, H200.shared_memory_per_sm // per_block)
    assert plan.blocks_per_sm == expected_blocks
    assert plan.occupancy == pytest.approx(expected_blocks * 128 / 2048)
    assert plan.waves == pytest.approx(plan.launch.blocks / (expected_blocks * 132))


def test_overflowing_problems_raise_plan_error_and_candidates_only_become_infeasible():
    with pytest.raises(PlanError, match="overflows u32"):
        plan_kernel(Problem(65536, 65536), KernelParams("tiled", threads=256), H200)
    with pytest.raises(PlanError, match="seq_len=0"):
        plan_kernel(Problem(0, 64), KernelParams("tiled", threads=256), H200)
    plan = tiled(2**20, 128, tile=16, target=1, batch=1, heads=16)
    assert not plan.feasible and "split scratch" in plan.reason


def test_scalar_plan_matches_its_kernel():
    problem = Problem(seq_len=1000, head_dim=64, batch=2, heads=2, causal=True)
    plan = plan_kernel(problem, KernelParams("scalar_online", threads=128), H200)
    assert plan.feasible
    assert plan.launch.grid == (8, 1, 4) and plan.launch.block == (128, 1, 1)
    assert plan.launch.shared_bytes == 128 * 64 * 4
    assert plan.compile_defines() == {"HEAD_DIM": 64, "THREADS": 128, "CAUSAL": 1}
    assert (plan.tile_size, plan.tile_count, plan.sequence_splits) == (1, 1000, 1)


@pytest.mark.parametrize("n, d", [(1, 32), (7, 32), (9, 7), (64, 64), (1000, 96), (4096, 128)])
def test_every_problem_has_feasible_candidates(n, d):
    space = candidate_space(Problem(seq_len=n, head_dim=d), H200)
    assert space.feasible
    keys = [plan.key() for plan in space.feasible + space.rejected]
    assert len(keys) == len(set(keys))
    assert all(plan.feasible and not plan.reason for plan in space.feasible)
    assert all(plan.reason and not plan.feasible for plan in space.rejected)


def test_threads_per_row_prefers_square_micro_tiles():
    assert choose_threads_per_row(64, 64, 256, 128) == 16  # 4 rows x 4 keys per lane
    assert choose_threads_per_row(16, 16, 1024, 128) is None


def test_importing_the_planner_loads_no_gpu_database_or_optuna_code():
    code = (
        "import sys, tuner.planner, tuner.device, tuner.problem;"
        "bad = [m for m in ('pycuda', 'sqlalchemy', 'optuna', 'torch', 'hydra', 'db')"
        " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
