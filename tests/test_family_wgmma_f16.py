"""The wgmma_f16 planning module (issue 14): feasibility, partition, defines, launches.

Pure: no GPU, no compiler. The shared-memory formula is checked against the numbers of
``kernels/wgmma_f16.cu``'s SMEM_BYTES, and the compile defines against the kernel's macros.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import build
from tuner.device import H200
from tuner.planner import families
from tuner.planner.families.wgmma_f16 import (
    FAMILY,
    MAX_CONSUMER_REGISTERS,
    consumer_registers,
    consumer_registers_needed,
    swizzle_row_bytes,
    swizzle_verdict,
    tma_verdict,
    wgmma_f16_shared_bytes,
)
from tuner.planner.launches import DeviceBuffers, TensorMap
from tuner.planner.params import KernelParams
from tuner.problem import Problem

KERNEL = Path(__file__).resolve().parent.parent / "kernels" / "wgmma_f16.cu"
BF16 = Problem(4096, 128, batch=4, heads=16, dtype="bfloat16")


@pytest.fixture
def registered() -> Iterator[None]:
    assert families.family_named(FAMILY.name) is FAMILY
    yield


def plan(problem: Problem = BF16, device=H200, **tunables: int):
    return FAMILY.plan(problem, KernelParams("wgmma_f16", **tunables), device)


def test_it_is_registered_for_the_half_dtypes_only() -> None:
    assert "wgmma_f16" in families.family_names()
    assert "wgmma_f16" in families.families_for("bfloat16")
    assert "wgmma_f16" in families.families_for("float16")
    assert "wgmma_f16" not in families.families_for("float32")


def test_shared_bytes_follow_the_kernels_layout() -> None:
    # Q: 2 consumers x 64 rows x 128 x 2 B; ring: 2 stages x (K, V) x 128 keys x 128 x 2 B;
    # 10 mbarriers of 8 B (q_full, q_empty; k_full, v_full, k_empty, v_empty a stage);
    # 1024 B to align.
    assert wgmma_f16_shared_bytes(2, 128, 2, 128) == 32768 + 131072 + 80 + 1024 == 164944
    text = KERNEL.read_text()
    for name in ("Q_TILE_BYTES", "KV_TILE_BYTES", "SMEM_BYTES", "BARRIERS"):
        assert re.search(rf"#define {name} ", text), name
    assert "#define BARRIERS (2 + 4 * STAGES)" in text


def test_the_default_plan_is_feasible_with_the_kernels_grid(registered: None) -> None:
    p = plan()
    assert p.feasible, p.reason
    assert p.launch.block == (384, 1, 1) and p.launch.grid == (32, 1, 64)
    assert p.launch.shared_bytes == 164944 and p.rows_per_block == 128
    assert FAMILY.key(p) == "wgmma_f16/c2/n128/st2/b1/o0/s1"
    assert FAMILY.compile_defines(p) == {
        "HEAD_DIM": 128, "CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "CAUSAL": 0,
        "IS_FP16": 0, "BLOCKS_PER_SM": 1, "OVERLAP": 0, "PINGPONG": 0, "STAGED_STORE": 0,
        "PERSISTENT": 0, "LATE_PACK": 0,
        "PRODUCER_REGISTERS": 24, "CONSUMER_REGISTERS": 240,
    }
    # every define is a macro the kernel (or its variant switches header) reads
    text = "".join(path.read_text() for path in build.included_files(KERNEL))
    for name in FAMILY.compile_defines(p):
        assert f"#ifndef {name}" in text, name


@pytest.mark.parametrize(
    ("tunables", "problem", "words"),
    [
        ({}, Problem(64, 64), "dtype float32 is not one of"),
        ({}, Problem(256, 80, dtype="bfloat16"),
         "head_dim=80 is not one of (64, 96, 128, 192, 256)"),
        ({"block_n": 72}, BF16, "block_n=72 is not one of (64, 80, 96, 112, 128, 144, 160"),
        # S + 2 P + O + 40 = 176 + 64 + 40: the two-set overlap spills at 176-key tiles
        ({"block_n": 176, "overlap": 1}, BF16, "needs about 280 registers"),
        ({"late_pack": 1}, BF16, "late_pack orders the overlapped loop's packing"),
        ({"late_pack": 2, "overlap": 1}, BF16, "late_pack=2: 0 or 1"),
        ({"stages": 5}, BF16, "2 to 4 stages"),
        ({"consumers": 4}, BF16, "one to three consumer warpgroups"),
        # three consumers get 160 registers: 128-key tiles at head_dim 128 need 64 + 64 + 32
        # + 16 + 160 / 10
        ({"consumers": 3}, BF16, "needs about 192 registers; setmaxnreg can give 160"),
        ({"consumers": 3, "blocks_per_sm": 2}, BF16, "2 only with 1"),
        ({"blocks_per_sm": 2, "consumers": 2}, BF16, "2 only with 1"),
        ({"pingpong": 1, "overlap": 0}, BF16, "two or three consumers, with overlap=1"),
        ({"pingpong": 1, "overlap": 1, "consumers": 1}, BF16, "two or three consumers"),
        ({"pingpong": 2, "overlap": 1}, BF16, "pingpong=2: 0 or 1"),
        ({"staged_store": 3}, BF16, "staged_store=3: 0, 1 (16-byte rows) or 2 (TMA stores)"),
        ({"rescale_slack": 4, "overlap": 1}, BF16, "rescale_slack=4: 0 or 8"),
        ({"rescale_slack": 8}, BF16, "rescale_slack skips the overlapped loop's rescales"),
        ({"staged_store": 1, "split_target": 2}, Problem(64, 128, kv_len=8192, dtype="bfloat16"),
         "staged_store stores a whole output"),
        # 32768 + 4 x 65536 + ... > 232448
        ({"stages": 4}, BF16, "exceeds the device's per-block opt-in limit 232448 B"),
        # two blocks of 148552 B do not share one SM's 233472 B
        ({"consumers": 1, "blocks_per_sm": 2}, BF16, "exceed the SM's 233472 B"),
        ({"consumers": 2}, Problem(64, 64, dtype="float16"), "block_m=128 is larger than needed"),
    ],
)
def test_infeasible_candidates_say_why(
    registered: None, tunables: dict[str, int], problem: Problem, words: str
) -> None:
    p = plan(problem, **tunables)
    assert not p.feasible and words in p.reason, p.reason


def test_only_hopper_runs_it(registered: None) -> None:
    ampere = dataclasses.replace(H200, compute_capability=(8, 0))
    assert "need sm_90a; the device is sm_80" in plan(device=ampere).reason


def test_the_register_split_is_judged(registered: None) -> None:
    # 64K registers: 24 x 128 for the producer, 240 a consumer thread (the cap)
    assert consumer_registers(2, 1, 65536) == 240 and consumer_registers(1, 2, 65536) == 232
    assert consumer_registers_needed(128, 128) == 64 + 64 + 32 + 40
    # the overlap keeps two P sets: 232 at head_dim 128 with 128-key tiles (ptxas: R231 the
    # highest register of that build), so it fits two consumers but not two blocks an SM
    assert consumer_registers_needed(128, 128, overlap=True) == 232
    # late packing keeps one: FlashAttention-3's 176-key tiles at head_dim 128 fit 240, and
    # its 80-key tiles at 256
    assert consumer_registers_needed(176, 128, overlap=True, late_pack=True) == 236
    assert consumer_registers_needed(80, 256, overlap=True, late_pack=True) == 228
    assert plan(block_n=176, overlap=1, late_pack=1).feasible
    # three consumers: 160 a consumer, 32 of it besides the accumulators (ptxas, nvcc 13.0:
    # late-packed 128-key tiles at head_dim 64 compile clean at 160, 112-key ones at 96 spill)
    assert consumer_registers(3, 1, 65536) == 160
    assert consumer_registers_needed(128, 64, True, True, target=160) == 64 + 32 + 32 + 32
    hd96 = Problem(4096, 96, batch=4, heads=16, dtype="bfloat16")
    assert "needs about 164" in plan(hd96, consumers=3, block_n=112, overlap=1, late_pack=1).reason
    assert plan(hd96, consumers=3, block_n=96, overlap=1, late_pack=1).feasible
    hd64 = Problem(4096, 64, batch=4, heads=16, dtype="bfloat16")
    three = plan(hd64, consumers=3, overlap=1, pingpong=1, late_pack=1)
    assert three.feasible, three.reason
    assert three.launch.block == (512, 1, 1) and three.rows_per_block == 192
    assert three.launch.grid == (22, 1, 64)  # ceil(4096 / 192) row blocks
    assert FAMILY.compile_defines(three)["CONSUMER_REGISTERS"] == 160
    assert FAMILY.key(three) == "wgmma_f16/c3/n128/st2/b1/o1/p1/lp/s1"
    assert "needs about" in plan(hd64, consumers=3, block_n=144, overlap=1, late_pack=1).reason
    assert FAMILY.key(plan(block_n=176, overlap=1, late_pack=1)).endswith("/o1/lp/s1")
    assert plan(overlap=1).feasible
    assert plan(overlap=2).reason == "overlap=2: 0 or 1"
    small = dataclasses.replace(H200, registers_per_sm=32768)
    p = plan(device=small)  # (256 - 24) / 2 = 116, 112 in steps of 8; 160 + 16 + 11 needed
    assert not p.feasible and "needs about 187 registers; setmaxnreg can give 112" in p.reason


def test_tma_and_swizzle_limits() -> None:
    assert tma_verdict(128, 4096, 64, 128) == ""
    assert "256-element box limit" in tma_verdict(128, 4096, 64, 512)
    assert "not multiples of 16" in tma_verdict(60, 4096, 64, 64)
    assert "2^32" in tma_verdict(128, 1 << 32, 1, 64)
    for consumers in (1, 2):
        for block_n in (64, 128):
            for stages in (2, 3, 4):
                for head_dim in (64, 96, 128, 192, 256):
                    assert swizzle_verdict(consumers, block_n, stages, head_dim) == ""
    # 96 columns are not whole 128-byte rows: the 64-byte swizzle; 80 fits neither
    assert swizzle_row_bytes(96) == 64 and swizzle_row_bytes(128) == swizzle_row_bytes(64) == 128
    assert "not whole 64-byte swizzle rows" in swizzle_verdict(1, 64, 2, 80)


def test_launches_lead_with_the_three_tensor_maps(registered: None) -> None:
    problem = Problem(1000, 128, batch=2, heads=16, kv_heads=4, kv_len=1500, dtype="float16")
    p = plan(problem, consumers=2, block_n=64, stages=3)
    (attention,) = FAMILY.launches(p, DeviceBuffers(0x1000, 0x2000, 0x3000, 0x4000))
    q_map, k_map, v_map = attention.args[:3]
    assert all(isinstance(m, TensorMap) for m in (q_map, k_map, v_map))
    assert (q_map.buffer, q_map.address) == ("q", 0x1000)
    assert (k_map.buffer, k_map.address, v_map.buffer, v_map.address) == ("k", 0x2000, "v", 0x3000)
    # [heads][rows][head_dim] row-major, 64-column boxes (one 128-byte swizzle row)
    assert q_map.dims == (128, 1000, 32) and q_map.box == (64, 64, 1)
    assert q_map.strides_bytes == (256, 1000 * 256)
    assert k_map.dims == v_map.dims == (128, 1500, 8) and k_map.box == (64, 64, 1)
    assert k_map.strides_bytes == (256, 1500 * 256)
    assert {m.dtype for m in (q_map, k_map, v_map)} == {"float16"}
    assert {m.swizzle_bytes for m in (q_map, k_map, v_map)} == {128}
    # then the split-KV contract: pointers, seq_len, kv_len, group, keys_per_split, scale
    assert [int(a) for a in attention.args[3:7]] == [0x1000, 0x2000, 0x3000, 0x4000]
    assert [int(a) for a in attention.args[9:13]] == [1000, 1500, 4, p.keys_per_sequence_split]
    assert attention.block == (384, 1, 1) and attention.grid == (8, 1, 32)


def test_the_ping_pong_is_a_tunable_of_the_overlapped_two_consumer_plan(registered: None) -> None:
    p = plan(overlap=1, pingpong=1, stages=3)
    assert p.feasible, p.reason
    assert FAMILY.compile_defines(p)["PINGPONG"] == 1
    # keys stored before the tunable existed are the keys of pingpong=0 plans
    assert FAMILY.key(p) == "wgmma_f16/c2/n128/st3/b1/o1/p1/s1"
    assert FAMILY.key(plan(overlap=1, stages=3)) == "wgmma_f16/c2/n128/st3/b1/o1/s1"
    stored = KernelParams.from_stored("wgmma_f16", {"consumers": 2, "overlap": 1})
    assert stored.pingpong == 0 and stored.staged_store == 0
    staged = plan(overlap=1, pingpong=1, stages=3, staged_store=1)
    assert staged.feasible and FAMILY.key(staged) == "wgmma_f16/c2/n128/st3/b1/o1/p1/ss/s1"
    assert FAMILY.compile_defines(staged)["STAGED_STORE"] == 1
    source = KERNEL.read_text()
    assert "#ifndef PINGPONG" in source and "fa::named_barrier_sync(1 + consumer, 256)" in source


def test_tma_stores_add_the_output_map_after_v(registered: None) -> None:
    """staged_store=2: the epilogue's TMA stores go through a fourth map, the Q map's twin
    over the output (same dims, strides, box and swizzle); the kernel takes it after v_map."""
    problem = Problem(1000, 96, batch=2, heads=8, kv_heads=2, causal=True, dtype="bfloat16")
    p = plan(problem, consumers=2, block_n=128, stages=2, overlap=1, pingpong=1, staged_store=2)
    assert p.feasible, p.reason
    assert FAMILY.key(p) == "wgmma_f16/c2/n128/st2/b1/o1/p1/ts/s1"
    assert FAMILY.compile_defines(p)["STAGED_STORE"] == 2
    (attention,) = FAMILY.launches(p, DeviceBuffers(0x1000, 0x2000, 0x3000, 0x4000))
    q_map, _, _, o_map = attention.args[:4]
    assert (o_map.buffer, o_map.address) == ("out", 0x4000)
    assert dataclasses.replace(o_map, buffer="q", address=0x1000) == q_map
    assert [int(a) for a in attention.args[4:8]] == [0x1000, 0x2000, 0x3000, 0x4000]
    source = KERNEL.read_text()
    assert "const __grid_constant__ CUtensorMap o_map," in source
    # a split's partials are float32 rows, not the output: no TMA stores there
    split = plan(Problem(64, 128, kv_len=8192, dtype="bfloat16"), overlap=1, staged_store=2,
                 split_target=2)
    assert "staged_store stores a whole output" in split.reason


def test_head_dim_96_takes_the_64_byte_swizzle(registered: None) -> None:
    # 192-byte rows: three 32-column chunks in the 64-byte swizzle (FlashAttention-3's and
    # CUTLASS's choice for a K extent of 96); the kernel derives the same span from HEAD_DIM.
    problem = Problem(1000, 96, batch=2, heads=8, kv_heads=2, causal=True, dtype="bfloat16")
    p = plan(problem, consumers=2, block_n=128, stages=2, overlap=1)
    assert p.feasible, p.reason
    (attention,) = FAMILY.launches(p, DeviceBuffers(0x1000, 0x2000, 0x3000, 0x4000))
    q_map, k_map, v_map = attention.args[:3]
    assert q_map.box == (32, 64, 1) and k_map.box == v_map.box == (32, 128, 1)
    assert q_map.strides_bytes == (192, 1000 * 192)
    assert {m.swizzle_bytes for m in (q_map, k_map, v_map)} == {64}
    assert FAMILY.compile_defines(p)["HEAD_DIM"] == 96
    source = KERNEL.read_text()
    assert "#define SWIZZLE_BYTES (HEAD_DIM % 64 == 0 ? 128 : 64)" in source
    # S, O and two P sets at 128-key tiles: 64 + 48 + 64 + 40 = 216 of 240
    assert consumer_registers_needed(128, 96, overlap=True) == 216


def test_a_split_plan_adds_the_merge_without_tensor_maps(registered: None) -> None:
    problem = Problem(64, 64, batch=1, heads=4, kv_len=8192, dtype="bfloat16")
    p = plan(problem, consumers=1, block_n=128, stages=2, split_target=8)
    assert p.feasible and p.sequence_splits > 1
    attention, merge = FAMILY.launches(p, DeviceBuffers(16, 32, 48, 64, 80, 96))
    assert isinstance(attention.args[0], TensorMap)
    assert merge.function == "wgmma_f16_split_merge"
    assert not any(isinstance(a, TensorMap) for a in merge.args)


@settings(max_examples=150, deadline=None)
@given(
    seq_len=st.integers(1, 20000),
    extra_keys=st.integers(0, 5000),
    head_dim=st.sampled_from([64, 96, 128]),
    causal=st.booleans(),
    consumers=st.sampled_from([1, 2]),
    block_n=st.sampled_from([64, 128]),
    stages=st.sampled_from([2, 3, 4]),
    blocks_per_sm=st.sampled_from([1, 2]),
    split_target=st.sampled_from([1, 2, 8, 1 << 16]),
    overlap=st.sampled_from([0, 1]),
    pingpong=st.sampled_from([0, 1]),
    staged_store=st.sampled_from([0, 1, 2]),
    persistent=st.sampled_from([0, 1]),
    rescale_slack=st.sampled_from([0, 8]),
)
def test_feasible_plans_keep_the_kernels_contract(
    seq_len: int, extra_keys: int, head_dim: int, causal: bool, consumers: int, block_n: int,
    stages: int, blocks_per_sm: int, split_target: int, overlap: int, pingpong: int,
    staged_store: int, persistent: int, rescale_slack: int,
) -> None:
    problem = Problem(seq_len, head_dim, batch=2, heads=8, kv_heads=2, causal=causal,
                      dtype="bfloat16", kv_len=seq_len + extra_keys)
    p = plan(problem, consumers=consumers, block_n=block_n, stages=stages,
             blocks_per_sm=blocks_per_sm, split_target=split_target, overlap=overlap,
             pingpong=pingpong, staged_store=staged_store, persistent=persistent,
             rescale_slack=rescale_slack)
    if not p.feasible:
        assert p.reason
        return
    # the ping-pong's turns are between two overlapped consumers (named barriers 1 and 2);
    # the staged epilogue stores a whole output, never a split's partials
    assert not pingpong or (consumers == 2 and overlap == 1)
    assert not staged_store or p.sequence_splits == 1
    assert ("/p1" in p.key()) == bool(pingpong)
    assert ("/ss" in p.key()) == (staged_store == 1) and ("/ts" in p.key()) == (staged_store == 2)
    # the output's map comes fourth with TMA stores only
    maps = [a for a in FAMILY.launches(p, DeviceBuffers(16, 32, 48, 64, 80, 96))[0].args
            if isinstance(a, TensorMap)]
    assert [m.buffer for m in maps] == ["q", "k", "v"] + ["out"] * (staged_store == 2)
    assert ("/ps" in p.key()) == bool(persistent)
    # the slack changes the overlapped loop; its define only where it is on (the cubins of
    # plans without it keep their names)
    assert not rescale_slack or overlap == 1
    assert ("/r8" in p.key()) == bool(rescale_slack)
    assert FAMILY.compile_defines(p).get("FA_RESCALE_SLACK", 0) == rescale_slack
    assert p.launch.shared_bytes <= H200.max_shared_memory_per_block_optin
    assert blocks_per_sm * (p.launch.shared_bytes + 1024) <= H200.shared_memory_per_sm
    assert p.keys_per_sequence_split % block_n == 0
    # the splits cover the keys and none is empty (the kernel's grid y)
    splits = p.sequence_splits
    assert (splits - 1) * p.keys_per_sequence_split < problem.kv_len
    assert splits * p.keys_per_sequence_split >= problem.kv_len
    row_blocks = -(-seq_len // (64 * consumers))
    if persistent:
        # one split; a block per SM slot, each walking more than one row block
        slots = H200.sm_count * blocks_per_sm
        assert splits == 1 and row_blocks * 16 > slots
        assert p.launch.grid == (slots, 1, 1)
        assert p.kernel_family.cost_terms(p).imbalance >= 1.0
    else:
        assert p.launch.grid == (row_blocks, splits, 16)
    assert (splits > 1) == (p.reduce_launch is not None)


def test_a_persistent_plan_walks_the_row_blocks_from_a_grid_of_sm_slots(
    registered: None,
) -> None:
    p = plan(overlap=1, stages=3, persistent=1)
    assert p.feasible, p.reason
    assert FAMILY.key(p) == "wgmma_f16/c2/n128/st3/b1/o1/ps/s1"
    assert FAMILY.compile_defines(p)["PERSISTENT"] == 1
    # 32 row blocks x 64 batch-heads walked by one block per SM; waves count the work
    assert p.launch.grid == (H200.sm_count, 1, 1)
    assert p.waves == pytest.approx(32 * 64 / H200.sm_count)
    (attention,) = FAMILY.launches(p, DeviceBuffers(0x1000, 0x2000, 0x3000, 0x4000))
    assert int(attention.args[-1]) == 64  # batch_heads, the queue's second factor
    # every item carries the same keys: the busiest block has ceil(2048 / 132) of them
    assert FAMILY.cost_terms(p).imbalance == pytest.approx(16 / (2048 / 132))
    # stored before the tunable existed: one block per row block
    stored = KernelParams.from_stored("wgmma_f16", {"consumers": 2, "overlap": 1})
    assert stored.persistent == 0
    source = KERNEL.read_text()
    assert "#ifndef PERSISTENT" in source and "int batch_heads)" in source


def test_persistence_is_refused_where_it_has_nothing_to_walk(registered: None) -> None:
    # one wave's worth of row blocks
    small = Problem(1024, 128, batch=1, heads=8, dtype="bfloat16")
    assert "nothing for a persistent block to walk" in plan(small, persistent=1).reason
    # splits store partials per (row block, split): the queue walks whole row blocks
    long_keys = Problem(64, 128, batch=1, heads=4, kv_len=65536, dtype="bfloat16")
    refused = plan(long_keys, consumers=1, split_target=8, persistent=1)
    assert "splits store partials" in refused.reason


@pytest.mark.parametrize("head_dim", [192, 256])
def test_wide_head_dims_fit_with_64_key_tiles(registered: None, head_dim: int) -> None:
    # Gemma 2's head_dim 256 (and 192): the O accumulators take head_dim / 2 registers a
    # consumer thread, so the register split and the shared-memory ring leave 64-key tiles.
    problem = Problem(4096, head_dim, batch=2, heads=16, kv_heads=8, causal=True, dtype="bfloat16")
    wide = plan(problem, consumers=2, block_n=64, stages=2, overlap=1)
    assert wide.feasible, wide.reason
    assert consumer_registers_needed(64, head_dim, overlap=True) <= MAX_CONSUMER_REGISTERS
    too_many = plan(problem, consumers=2, block_n=128, stages=2, overlap=1)
    assert not too_many.feasible
