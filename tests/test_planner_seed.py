"""Tests for the Python port of the seed flash-attention planner.

The seed (``/work/shared/seed/flash_attention_planner.rs``) is the baseline
every tuned plan is measured against, so the port is held to it exactly: the
seed's own tests, hand-computed plans, every error text and its precedence,
the u32/u64 edges, and hypothesis properties checked against an independent
reference written straight from the Rust text.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.planner.errors import PlanError
from tuner.planner.seed import (
    COOPERATIVE_TILED_WORKGROUP_LANES,
    F32_BYTES,
    FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS,
    FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT,
    SCALAR_ONLINE_WORKGROUP_LANES,
    WARP_LANES,
    FlashAttentionBenchMetrics,
    FlashAttentionKernelKind,
    FlashAttentionMemoryTraffic,
    FlashAttentionWorkPlan,
    _square_times_dim,
    occupancy_proxy_bps,
    plan_flash_attention_scalar,
    plan_flash_attention_tiled,
    sequence_parallel_splits,
    split_reduce_scratch_elements,
)

U32 = 2**32 - 1
U64 = 2**64 - 1

PLAN_FIELDS = [
    "kernel",
    "seq_len",
    "head_dim",
    "tile_size",
    "tile_count",
    "sequence_splits",
    "tiles_per_sequence_split",
    "keys_per_sequence_split",
    "rows_per_block",
    "parallel_workgroups_per_row",
    "workgroup_lanes",
    "warp_lanes",
    "warps_per_block",
    "logical_elements",
    "q_scratch_elements",
    "score_scratch_elements",
    "o_acc_scratch_elements",
    "split_reduce_scratch_elements",
    "bench_metrics",
]


# --------------------------------------------------------------------------
# Independent reference, written line by line from the Rust text with plain
# Python ints (no tuner.planner.fixed_width), used to cross-check the port.
# --------------------------------------------------------------------------


class _RefError(Exception):
    pass


def _ref_mul32(lhs: int, rhs: int, context: str) -> int:
    if lhs * rhs > U32:
        raise _RefError(f"Fix: {context} dimensions overflow u32: {lhs}*{rhs}.")
    return lhs * rhs


def _ref_dims(context: str, seq_len: int, head_dim: int) -> int:
    if seq_len == 0:
        raise _RefError(f"{context} seq_len=0 is invalid: empty sequence")
    if head_dim == 0:
        raise _RefError(f"{context} head_dim=0 is invalid: empty head dimension")
    return _ref_mul32(seq_len, head_dim, context)


def _sat(value: int) -> int:
    return min(value, U64)


def _ref_occupancy(active: int, lanes: int) -> int:
    return 0 if lanes == 0 else max(min(active, lanes), 1) * 10_000 // lanes


def _ref_scalar(seq_len: int, head_dim: int) -> dict[str, Any]:
    logical = _ref_dims("flash_attention", seq_len, head_dim)
    q = _ref_mul32(128, head_dim, "flash_attention q/o scratch")
    pair = seq_len * seq_len * head_dim
    assert pair <= U64  # the u64 checks cannot fire once seq_len*head_dim fits u32
    return {
        "kernel": FlashAttentionKernelKind.SCALAR_ONLINE,
        "seq_len": seq_len,
        "head_dim": head_dim,
        "tile_size": 1,
        "tile_count": seq_len,
        "sequence_splits": 1,
        "tiles_per_sequence_split": seq_len,
        "keys_per_sequence_split": seq_len,
        "rows_per_block": 1,
        "parallel_workgroups_per_row": 1,
        "workgroup_lanes": 128,
        "warp_lanes": 32,
        "warps_per_block": 4,
        "logical_elements": logical,
        "q_scratch_elements": q,
        "score_scratch_elements": 0,
        "o_acc_scratch_elements": q,
        "split_reduce_scratch_elements": 0,
        "output_tolerance_abs": 1e-3,
        "global_read_bytes": _sat(_sat(pair * 3) * 4),
        "global_write_bytes": seq_len * head_dim * 4,
        "shared_memory_bytes": q * 4,
        "occupancy_proxy_bps": _ref_occupancy(max(head_dim, 1), 128),
        "non_matmul_flops": _sat(_sat(seq_len * seq_len * 9) + seq_len * head_dim * 4),
    }


def _ref_tiled(seq_len: int, head_dim: int, tile_size: int) -> dict[str, Any]:
    logical = _ref_dims("flash_attention_2", seq_len, head_dim)
    if tile_size == 0:
        raise _RefError("Fix: flash_attention_2 tile_size must be > 0")
    tile_count = -(-seq_len // tile_size)
    splits = max(-(-tile_count // 4), 1)
    per_split = -(-tile_count // splits)
    if tile_size * per_split > U32:
        raise _RefError("Fix: flash_attention_2 split key span overflows u32")
    keys = min(tile_size * per_split, seq_len)
    q = _ref_mul32(64, head_dim, "flash_attention_2 q_scratch")
    score = _ref_mul32(64, tile_size, "flash_attention_2 score_scratch")
    o_acc = _ref_mul32(64, head_dim, "flash_attention_2 o_acc")
    if head_dim + 2 > U32:
        raise _RefError("Fix: flash_attention_2 split reduction state overflows u32")
    split_reduce = _ref_mul32(splits, head_dim + 2, "flash_attention_2 split reduction scratch")
    partial = 0
    for term in (q, score, o_acc, split_reduce):
        partial += term
        if partial > U32:
            raise _RefError("Fix: flash_attention_2 shared scratch overflows u32")
    pair = seq_len * seq_len * head_dim
    assert pair <= U64
    row = seq_len * head_dim
    flops = _sat(seq_len * seq_len * 4)
    flops = _sat(flops + _sat(seq_len * tile_count * 8))
    flops = _sat(flops + row * 3)
    flops = _sat(flops + _sat(seq_len * (splits - 1) * head_dim * 3))
    return {
        "kernel": FlashAttentionKernelKind.COOPERATIVE_TILED,
        "seq_len": seq_len,
        "head_dim": head_dim,
        "tile_size": tile_size,
        "tile_count": tile_count,
        "sequence_splits": splits,
        "tiles_per_sequence_split": per_split,
        "keys_per_sequence_split": keys,
        "rows_per_block": 1,
        "parallel_workgroups_per_row": splits,
        "workgroup_lanes": 64,
        "warp_lanes": 32,
        "warps_per_block": 2,
        "logical_elements": logical,
        "q_scratch_elements": q,
        "score_scratch_elements": score,
        "o_acc_scratch_elements": o_acc,
        "split_reduce_scratch_elements": split_reduce,
        "output_tolerance_abs": 1e-3,
        "global_read_bytes": _sat(_sat(_sat(pair * 2) + row) * 4),
        "global_write_bytes": row * 4,
        "shared_memory_bytes": partial * 4,
        "occupancy_proxy_bps": _ref_occupancy(max(head_dim, tile_size), 64),
        "non_matmul_flops": flops,
    }


def _flat(plan: FlashAttentionWorkPlan) -> dict[str, Any]:
    """One flat dict of a plan (nested metrics and traffic merged in)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(plan):
        value = getattr(plan, field.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(value))  # type: ignore[arg-type]
        else:
            out[field.name] = value
    return out


def _outcome(fn: Any, *args: int) -> tuple[str, Any]:
    try:
        result = fn(*args)
    except (PlanError, _RefError) as error:
        return ("error", str(error))
    return ("ok", _flat(result) if isinstance(result, FlashAttentionWorkPlan) else result)


# --------------------------------------------------------------------------
# The seed's three tests, with its numbers.
# --------------------------------------------------------------------------


def test_tiled_plan_reports_lower_global_reads_than_scalar_baseline() -> None:
    scalar = plan_flash_attention_scalar(128, 64)
    tiled = plan_flash_attention_tiled(128, 64, 64)

    assert scalar.kernel is FlashAttentionKernelKind.SCALAR_ONLINE
    assert tiled.kernel is FlashAttentionKernelKind.COOPERATIVE_TILED
    assert tiled.workgroup_lanes == 64
    assert tiled.warp_lanes == 32
    assert tiled.warps_per_block == 2
    assert tiled.tile_count == 2
    assert tiled.sequence_splits == 1
    assert tiled.parallel_workgroups_per_row == 1
    assert (
        tiled.bench_metrics.memory_traffic.global_read_bytes
        < scalar.bench_metrics.memory_traffic.global_read_bytes
    )
    assert tiled.bench_metrics.memory_traffic.shared_memory_bytes > 0
    assert tiled.bench_metrics.occupancy_proxy_bps > 0
    assert tiled.bench_metrics.non_matmul_flops > 0
    assert tiled.bench_metrics.output_tolerance_abs == FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS


def test_sequence_parallel_tiled_plan_splits_long_rows_and_reports_work() -> None:
    scalar = plan_flash_attention_scalar(4096, 128)
    tiled = plan_flash_attention_tiled(4096, 128, 128)

    assert tiled.tile_count == 32
    assert tiled.sequence_splits == 8
    assert (
        tiled.tiles_per_sequence_split == FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT
    )
    assert tiled.keys_per_sequence_split == 512
    assert tiled.parallel_workgroups_per_row == tiled.sequence_splits
    assert tiled.split_reduce_scratch_elements == tiled.sequence_splits * (tiled.head_dim + 2)
    assert tiled.bench_metrics.memory_traffic.shared_memory_bytes > 0
    assert tiled.bench_metrics.occupancy_proxy_bps > 0
    assert tiled.bench_metrics.non_matmul_flops > 0
    assert tiled.bench_metrics.non_matmul_flops < scalar.bench_metrics.non_matmul_flops


def test_shared_planner_feeds_flash_attention_builders() -> None:
    # The seed also checks these plans against its program builders (workgroup
    # size and the flash_o / score_tile buffer counts). Those builders do not
    # exist here: the launch-configuration half is tested against the real
    # CUDA launch in the kernels tests. What the seed asserts about the plans:
    scalar = plan_flash_attention_scalar(9, 7)
    assert scalar.workgroup_lanes == 128
    assert scalar.o_acc_scratch_elements == 128 * 7

    tiled = plan_flash_attention_tiled(8, 16, 4)
    assert tiled.workgroup_lanes == 64
    assert tiled.score_scratch_elements == 64 * 4


# --------------------------------------------------------------------------
# Constants, types and hand-computed plans.
# --------------------------------------------------------------------------


def test_constants_match_the_seed() -> None:
    assert FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS == 1e-3
    assert FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT == 4
    assert SCALAR_ONLINE_WORKGROUP_LANES == 128
    assert COOPERATIVE_TILED_WORKGROUP_LANES == 64
    assert WARP_LANES == 32
    assert F32_BYTES == 4
    assert FlashAttentionKernelKind.SCALAR_ONLINE.value == "ScalarOnline"
    assert FlashAttentionKernelKind.COOPERATIVE_TILED.value == "CooperativeTiled"


def test_dataclasses_have_the_seed_fields_in_order_and_are_frozen() -> None:
    assert [f.name for f in dataclasses.fields(FlashAttentionWorkPlan)] == PLAN_FIELDS
    assert [f.name for f in dataclasses.fields(FlashAttentionBenchMetrics)] == [
        "output_tolerance_abs",
        "memory_traffic",
        "occupancy_proxy_bps",
        "non_matmul_flops",
    ]
    assert [f.name for f in dataclasses.fields(FlashAttentionMemoryTraffic)] == [
        "global_read_bytes",
        "global_write_bytes",
        "shared_memory_bytes",
    ]
    plan = plan_flash_attention_scalar(1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.seq_len = 2  # type: ignore[misc]
    assert not hasattr(plan, "__dict__")  # slots
    assert plan == plan_flash_attention_scalar(1, 1)
    assert hash(plan) == hash(plan_flash_attention_scalar(1, 1))


def _plan(
    kernel: FlashAttentionKernelKind,
    fields: tuple[int, ...],
    traffic: tuple[int, int, int],
    occupancy: int,
    flops: int,
) -> FlashAttentionWorkPlan:
    return FlashAttentionWorkPlan(
        kernel,
        *fields,
        bench_metrics=FlashAttentionBenchMetrics(
            1e-3, FlashAttentionMemoryTraffic(*traffic), occupancy, flops
        ),
    )


SCALAR = FlashAttentionKernelKind.SCALAR_ONLINE
TILED = FlashAttentionKernelKind.COOPERATIVE_TILED

# Fields after `kernel`, in order: seq_len head_dim tile_size tile_count
# sequence_splits tiles_per_split keys_per_split rows_per_block
# parallel_workgroups_per_row workgroup_lanes warp_lanes warps_per_block
# logical q_scratch score_scratch o_acc split_reduce.
HAND_COMPUTED = [
    (
        plan_flash_attention_scalar,
        (4096, 128),
        _plan(
            SCALAR,
            (4096, 128, 1, 4096, 1, 4096, 4096, 1, 1, 128, 32, 4, 524288, 16384, 0, 16384, 0),
            # 4096^2*128 = 2^31 pairs*dim; *3*4 reads; 524288*4 writes; 16384*4 shared
            (25769803776, 2097152, 65536),
            10000,
            # 4096^2*9 + 524288*4
            153092096,
        ),
    ),
    (
        plan_flash_attention_tiled,
        (4096, 128, 128),
        _plan(
            TILED,
            (4096, 128, 128, 32, 8, 4, 512, 1, 8, 64, 32, 2, 524288, 8192, 8192, 8192, 1040),
            # (2^31*2 + 524288)*4; shared (3*8192 + 8*130)*4
            (17181966336, 2097152, 102464),
            10000,
            # 4096^2*4 + 4096*32*8 + 524288*3 + 4096*7*128*3
            80740352,
        ),
    ),
    (
        plan_flash_attention_scalar,
        (1, 1),
        _plan(
            SCALAR,
            (1, 1, 1, 1, 1, 1, 1, 1, 1, 128, 32, 4, 1, 128, 0, 128, 0),
            (12, 4, 512), 78, 13,
        ),
    ),
    (
        plan_flash_attention_tiled,
        (1, 1, 1),
        # shared 64+64+64+3 = 195; occupancy 10000/64 = 156; flops 4+8+3+0
        _plan(
            TILED,
            (1, 1, 1, 1, 1, 1, 1, 1, 1, 64, 32, 2, 1, 64, 64, 64, 3),
            (12, 4, 780), 156, 15,
        ),
    ),
    (
        plan_flash_attention_scalar,
        (9, 7),
        # 81*7 = 567 pairs*dim; occupancy 70000/128 = 546; flops 729 + 252
        _plan(
            SCALAR,
            (9, 7, 1, 9, 1, 9, 9, 1, 1, 128, 32, 4, 63, 896, 0, 896, 0),
            (6804, 252, 3584), 546, 981,
        ),
    ),
    (
        plan_flash_attention_tiled,
        (9, 7, 4),
        # 3 tiles, 1 split; keys min(12, 9); shared 448+256+448+9 = 1161;
        # reads (1134+63)*4; occupancy 70000/64 = 1093; flops 324+216+189+0
        _plan(
            TILED,
            (9, 7, 4, 3, 1, 3, 9, 1, 1, 64, 32, 2, 63, 448, 256, 448, 9),
            (4788, 252, 4644), 1093, 729,
        ),
    ),
    (
        plan_flash_attention_tiled,
        (10, 4, 100),
        # tile_size > seq_len: one tile, keys clamp to seq_len, occupancy clamps to 64 lanes.
        # shared 256+6400+256+6 = 6918; reads (800+40)*4; flops 400+80+120+0
        _plan(
            TILED,
            (10, 4, 100, 1, 1, 1, 10, 1, 1, 64, 32, 2, 40, 256, 6400, 256, 6),
            (3360, 160, 27672), 10000, 600,
        ),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("planner", "args", "expected"), HAND_COMPUTED)
def test_hand_computed_plans(planner: Any, args: tuple[int, ...], expected: Any) -> None:
    assert planner(*args) == expected


@pytest.mark.parametrize(("planner", "args", "expected"), HAND_COMPUTED)
def test_reference_agrees_with_hand_computed_plans(
    planner: Any, args: tuple[int, ...], expected: Any
) -> None:
    reference = _ref_scalar if planner is plan_flash_attention_scalar else _ref_tiled
    assert reference(*args) == _flat(expected)


def test_output_tolerance_is_the_documented_constant_not_the_f32_widening() -> None:
    tolerance = plan_flash_attention_tiled(8, 16, 4).bench_metrics.output_tolerance_abs
    assert tolerance == FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS == 1e-3
    assert tolerance != 0.0010000000474974513  # what Rust's 1.0e-3_f32 widens to


# --------------------------------------------------------------------------
# Every error text, in the seed's order of precedence.
# --------------------------------------------------------------------------

ERRORS = [
    (plan_flash_attention_scalar, (0, 0), "flash_attention seq_len=0 is invalid: empty sequence"),
    (plan_flash_attention_scalar, (0, U32), "flash_attention seq_len=0 is invalid: empty sequence"),
    (
        plan_flash_attention_scalar,
        (5, 0),
        "flash_attention head_dim=0 is invalid: empty head dimension",
    ),
    (
        plan_flash_attention_scalar,
        (65536, 65536),
        "Fix: flash_attention dimensions overflow u32: 65536*65536.",
    ),
    (
        plan_flash_attention_scalar,
        (U32, U32),
        f"Fix: flash_attention dimensions overflow u32: {U32}*{U32}.",
    ),
    (
        plan_flash_attention_scalar,
        (1, 2**25),
        "Fix: flash_attention q/o scratch dimensions overflow u32: 128*33554432.",
    ),
    (
        plan_flash_attention_scalar,
        (1, U32),
        f"Fix: flash_attention q/o scratch dimensions overflow u32: 128*{U32}.",
    ),
    (
        plan_flash_attention_tiled,
        (0, 0, 0),
        "flash_attention_2 seq_len=0 is invalid: empty sequence",
    ),
    (
        plan_flash_attention_tiled,
        (1, 0, 0),
        "flash_attention_2 head_dim=0 is invalid: empty head dimension",
    ),
    (
        plan_flash_attention_tiled,
        (65536, 65536, 0),  # dims overflow wins over tile_size=0
        "Fix: flash_attention_2 dimensions overflow u32: 65536*65536.",
    ),
    (plan_flash_attention_tiled, (1, 1, 0), "Fix: flash_attention_2 tile_size must be > 0"),
    (
        plan_flash_attention_tiled,
        # 2 tiles, 1 split of 2 tiles: 2^31*2 = 2^32 keys; wins over score scratch.
        (U32, 1, 2**31),
        "Fix: flash_attention_2 split key span overflows u32",
    ),
    (
        plan_flash_attention_tiled,
        (1, 2**26, 2**26),  # q_scratch wins over score_scratch
        "Fix: flash_attention_2 q_scratch dimensions overflow u32: 64*67108864.",
    ),
    (
        plan_flash_attention_tiled,
        (1, 1, 2**26),
        "Fix: flash_attention_2 score_scratch dimensions overflow u32: 64*67108864.",
    ),
    (
        plan_flash_attention_tiled,
        (1, 1, U32),
        f"Fix: flash_attention_2 score_scratch dimensions overflow u32: 64*{U32}.",
    ),
    (
        plan_flash_attention_tiled,
        # 64 + 64*67108862 + 64 + 3 = 2^32 + 3
        (1, 1, 67108862),
        "Fix: flash_attention_2 shared scratch overflows u32",
    ),
    (
        plan_flash_attention_tiled,
        # the first add alone overflows: 64 + 64*(2^26-1) = 2^32
        (1, 1, 2**26 - 1),
        "Fix: flash_attention_2 shared scratch overflows u32",
    ),
]


@pytest.mark.parametrize(("planner", "args", "message"), ERRORS)
def test_error_texts_and_precedence(planner: Any, args: tuple[int, ...], message: str) -> None:
    with pytest.raises(PlanError) as caught:
        planner(*args)
    assert str(caught.value) == message
    reference = _ref_scalar if planner is plan_flash_attention_scalar else _ref_tiled
    assert _outcome(reference, *args) == ("error", message)


def test_plan_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        plan_flash_attention_tiled(1, 1, 0)


@pytest.mark.parametrize("name", ["seq_len", "head_dim", "tile_size"])
@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, True, False, 1.0, "3", None])
def test_inputs_must_be_u32_ints(name: str, bad: object) -> None:
    args: dict[str, object] = {"seq_len": 4, "head_dim": 4, "tile_size": 4}
    args[name] = bad
    with pytest.raises(PlanError, match=rf"^Fix: {name}=.* must fit u32"):
        plan_flash_attention_tiled(**args)  # type: ignore[arg-type]
    if name != "tile_size":
        args.pop("tile_size")
        with pytest.raises(PlanError, match=rf"^Fix: {name}=.* must fit u32"):
            plan_flash_attention_scalar(**args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# u32 / u64 edges.
# --------------------------------------------------------------------------


def test_logical_elements_exactly_u32_max_is_accepted() -> None:
    # 65535 * 65537 = 2^32 - 1
    scalar = plan_flash_attention_scalar(65535, 65537)
    assert scalar.logical_elements == U32
    assert scalar.q_scratch_elements == 128 * 65537
    tiled = plan_flash_attention_tiled(65535, 65537, 1)
    assert tiled.logical_elements == U32
    assert (tiled.tile_count, tiled.sequence_splits, tiled.tiles_per_sequence_split) == (
        65535,
        16384,
        4,
    )
    assert tiled.split_reduce_scratch_elements == 16384 * 65539
    assert plan_flash_attention_scalar(U32, 1).logical_elements == U32
    assert plan_flash_attention_scalar(1, 2**25 - 1).q_scratch_elements == 2**32 - 128


def test_scalar_q_scratch_edge() -> None:
    with pytest.raises(PlanError, match=r"q/o scratch dimensions overflow u32: 128\*33554432\."):
        plan_flash_attention_scalar(1, 2**25)
    assert plan_flash_attention_scalar(128, 2**25 - 1).o_acc_scratch_elements == 2**32 - 128


def test_split_key_span_edge() -> None:
    # The span can only overflow for tile_size > 2^30, where 64*tile_size overflows
    # too, so this edge is about precedence: the span check comes first.
    # (2^32-1)/(2^31-1) needs 3 tiles: span 3*(2^31-1) > u32.
    with pytest.raises(PlanError, match="^Fix: flash_attention_2 split key span overflows u32$"):
        plan_flash_attention_tiled(U32, 1, 2**31 - 1)
    # (2^32-2)/(2^31-1) is exactly 2 tiles: span 2^32-2 fits, so score scratch fails next.
    with pytest.raises(PlanError, match=r"score_scratch dimensions overflow u32: 64\*2147483647\."):
        plan_flash_attention_tiled(2**32 - 2, 1, 2**31 - 1)
    # One tile (tile_size == seq_len): the span is tile_size itself.
    with pytest.raises(PlanError, match="score_scratch"):
        plan_flash_attention_tiled(2**31, 1, 2**31)


def test_shared_scratch_sum_edge() -> None:
    # 64 + 64*67108861 + 64 + 3 = 2^32 - 61: the largest tile that fits for (1, 1).
    plan = plan_flash_attention_tiled(1, 1, 67108861)
    assert plan.score_scratch_elements == 4294967104
    assert plan.bench_metrics.memory_traffic.shared_memory_bytes == 4294967235 * 4
    assert plan.keys_per_sequence_split == 1  # tile_size far beyond seq_len
    assert plan.bench_metrics.occupancy_proxy_bps == 10000
    with pytest.raises(PlanError, match="^Fix: flash_attention_2 shared scratch overflows u32$"):
        plan_flash_attention_tiled(1, 1, 67108862)


def test_scalar_traffic_saturates_only_after_multiplying() -> None:
    plan = plan_flash_attention_scalar(U32, 1)
    traffic = plan.bench_metrics.memory_traffic
    # seq_len^2*head_dim = (2^32-1)^2 fits u64; *3 saturates.
    assert U32 * U32 <= U64 < U32 * U32 * 3
    assert traffic.global_read_bytes == U64
    assert traffic.global_write_bytes == U32 * 4
    assert traffic.shared_memory_bytes == 128 * 4
    assert plan.bench_metrics.non_matmul_flops == U64
    assert plan.bench_metrics.occupancy_proxy_bps == 78


@pytest.mark.parametrize(
    ("seq_len", "saturated"),
    [(1239850262, False), (1239850263, True)],
)
def test_scalar_read_bytes_saturation_threshold(seq_len: int, saturated: bool) -> None:
    reads = plan_flash_attention_scalar(seq_len, 1).bench_metrics.memory_traffic.global_read_bytes
    exact = seq_len * seq_len * 12
    assert (exact > U64) is saturated
    assert reads == (U64 if saturated else exact)


@pytest.mark.parametrize(
    ("seq_len", "saturated"),
    [(1431655765, False), (1431655766, True)],
)
def test_scalar_flops_saturation_threshold(seq_len: int, saturated: bool) -> None:
    flops = plan_flash_attention_scalar(seq_len, 1).bench_metrics.non_matmul_flops
    exact = seq_len * seq_len * 9 + seq_len * 4
    assert (exact > U64) is saturated
    assert flops == (U64 if saturated else exact)


@pytest.mark.parametrize(
    ("seq_len", "saturated"),
    [(1518500249, False), (1518500250, True)],
)
def test_tiled_read_bytes_saturation_threshold(seq_len: int, saturated: bool) -> None:
    plan = plan_flash_attention_tiled(seq_len, 1, 2**20)
    exact = (seq_len * seq_len * 2 + seq_len) * 4
    assert (exact > U64) is saturated
    assert plan.bench_metrics.memory_traffic.global_read_bytes == (U64 if saturated else exact)


def test_tiled_traffic_and_flops_saturate_at_u32_max_seq_len() -> None:
    plan = plan_flash_attention_tiled(U32, 1, 2**20)
    assert (plan.tile_count, plan.sequence_splits, plan.tiles_per_sequence_split) == (4096, 1024, 4)
    assert plan.keys_per_sequence_split == 2**22
    assert plan.split_reduce_scratch_elements == 1024 * 3
    metrics = plan.bench_metrics
    assert metrics.memory_traffic.global_read_bytes == U64
    assert metrics.memory_traffic.global_write_bytes == U32 * 4
    assert metrics.memory_traffic.shared_memory_bytes == (64 + 2**26 + 64 + 3072) * 4
    assert metrics.non_matmul_flops == U64


def test_occupancy_clamps() -> None:
    assert occupancy_proxy_bps(0, 64) == 156  # at least one active lane
    assert occupancy_proxy_bps(1, 64) == 156
    assert occupancy_proxy_bps(32, 64) == 5000
    assert occupancy_proxy_bps(64, 64) == 10000
    assert occupancy_proxy_bps(10_000, 64) == 10000
    assert occupancy_proxy_bps(U32, U32) == 10000
    assert occupancy_proxy_bps(1, U32) == 0  # 10000 // (2^32 - 1)
    assert occupancy_proxy_bps(5, 0) == 0
    assert plan_flash_attention_scalar(1, 1000).bench_metrics.occupancy_proxy_bps == 10000
    assert plan_flash_attention_tiled(8, 1, 2).bench_metrics.occupancy_proxy_bps == 312


# --------------------------------------------------------------------------
# The helpers the tunable planner imports.
# --------------------------------------------------------------------------


def test_sequence_parallel_splits() -> None:
    assert sequence_parallel_splits(0) == 1  # 0.div_ceil(4) = 0, then max(1)
    assert [sequence_parallel_splits(n) for n in range(1, 10)] == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert sequence_parallel_splits(U32) == 2**30
    assert sequence_parallel_splits(10, target=3) == 4
    assert sequence_parallel_splits(10, target=1) == 10
    assert sequence_parallel_splits(10, target=U32) == 1
    with pytest.raises(PlanError):
        sequence_parallel_splits(10, target=0)
    with pytest.raises(PlanError, match="must fit u32"):
        sequence_parallel_splits(-1)


def test_split_reduce_scratch_elements() -> None:
    assert split_reduce_scratch_elements(8, 128) == 1040
    assert split_reduce_scratch_elements(1, U32 - 2) == U32
    with pytest.raises(PlanError) as caught:
        split_reduce_scratch_elements(2, U32 - 2)
    assert str(caught.value) == (
        f"Fix: flash_attention_2 split reduction scratch dimensions overflow u32: 2*{U32}."
    )
    for head_dim in (U32 - 1, U32):
        with pytest.raises(PlanError) as caught:
            split_reduce_scratch_elements(1, head_dim)
        assert str(caught.value) == "Fix: flash_attention_2 split reduction state overflows u32"


def test_square_times_dim_errors_are_kept_though_unreachable_from_the_planners() -> None:
    assert _square_times_dim(U32, 1, "ctx") == U32 * U32
    with pytest.raises(PlanError) as caught:
        _square_times_dim(U32, U32, "ctx")
    assert str(caught.value) == "Fix: ctx seq_len^2*head_dim overflows u64."
    with pytest.raises(PlanError) as caught:
        _square_times_dim(2**32, 1, "ctx")  # only reachable outside u32
    assert str(caught.value) == "Fix: ctx seq_len^2 overflows u64."


# --------------------------------------------------------------------------
# Properties over the whole u32 range.
# --------------------------------------------------------------------------

_POWERS = [2**k for k in range(33) if 2**k <= U32]
_EDGY = st.sampled_from(sorted({v for p in _POWERS for v in (p - 1, p, p + 1) if 0 <= v <= U32}))
U32S = st.one_of(
    st.integers(0, 300),
    _EDGY,
    st.integers(U32 - 300, U32),
    st.integers(0, U32),
)


@st.composite
def _fitting_dims(draw: st.DrawFn) -> tuple[int, int]:
    """(seq_len, head_dim) with seq_len*head_dim in u32, so plans mostly succeed."""
    seq_len = draw(st.one_of(st.integers(1, 300), _EDGY.filter(bool), st.integers(1, U32)))
    cap = U32 // seq_len
    head_dim = draw(st.one_of(st.integers(1, min(cap, 300)), st.integers(1, cap), st.just(cap)))
    return seq_len, head_dim


TILED_DIMS = st.one_of(
    st.tuples(U32S, U32S, U32S),
    st.tuples(_fitting_dims(), U32S).map(lambda t: (*t[0], t[1])),
    st.tuples(_fitting_dims(), st.integers(1, 4096)).map(lambda t: (*t[0], t[1])),
)

SEED_ERROR_PATTERNS = (
    "flash_attention_2 seq_len=0 is invalid: empty sequence",
    "flash_attention_2 head_dim=0 is invalid: empty head dimension",
    "Fix: flash_attention_2 dimensions overflow u32: ",
    "Fix: flash_attention_2 tile_size must be > 0",
    "Fix: flash_attention_2 split key span overflows u32",
    "Fix: flash_attention_2 q_scratch dimensions overflow u32: 64*",
    "Fix: flash_attention_2 score_scratch dimensions overflow u32: 64*",
    "Fix: flash_attention_2 o_acc dimensions overflow u32: 64*",
    "Fix: flash_attention_2 split reduction state overflows u32",
    "Fix: flash_attention_2 split reduction scratch dimensions overflow u32: ",
    "Fix: flash_attention_2 shared scratch overflows u32",
)


@settings(max_examples=600, deadline=None)
@given(TILED_DIMS)
def test_tiled_plan_properties(dims: tuple[int, int, int]) -> None:
    seq_len, head_dim, tile_size = dims
    outcome = _outcome(plan_flash_attention_tiled, seq_len, head_dim, tile_size)
    assert outcome == _outcome(_ref_tiled, seq_len, head_dim, tile_size)
    if outcome[0] == "error":
        assert str(outcome[1]).startswith(SEED_ERROR_PATTERNS)
        return
    plan = plan_flash_attention_tiled(seq_len, head_dim, tile_size)
    count, splits, per_split = (
        plan.tile_count,
        plan.sequence_splits,
        plan.tiles_per_sequence_split,
    )
    assert count == -(-seq_len // tile_size)
    assert splits == max(1, -(-count // 4))
    assert per_split * splits >= count
    # No empty split: holds for the seed's rule (ceil(T/4) splits of ceil(T/S)).
    assert (splits - 1) * per_split < count
    assert per_split <= FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT
    assert plan.keys_per_sequence_split == min(tile_size * per_split, seq_len)
    assert plan.split_reduce_scratch_elements == splits * (head_dim + 2)
    assert plan.parallel_workgroups_per_row == splits
    flat = _flat(plan)
    for name in ("global_read_bytes", "global_write_bytes", "shared_memory_bytes"):
        assert 0 <= flat[name] <= U64
    assert 0 <= flat["non_matmul_flops"] <= U64
    for name, value in flat.items():
        if isinstance(value, int) and name not in (
            "global_read_bytes",
            "global_write_bytes",
            "shared_memory_bytes",
            "non_matmul_flops",
        ):
            assert 0 <= value <= U32, name


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.tuples(U32S, U32S), _fitting_dims()))
def test_scalar_plan_raises_exactly_on_empty_or_overflowing_dims(dims: tuple[int, int]) -> None:
    seq_len, head_dim = dims
    should_fail = seq_len == 0 or head_dim == 0 or seq_len * head_dim > U32 or 128 * head_dim > U32
    outcome = _outcome(plan_flash_attention_scalar, seq_len, head_dim)
    assert (outcome[0] == "error") is should_fail
    assert outcome == _outcome(_ref_scalar, seq_len, head_dim)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, U32), st.integers(1, 64))
def test_no_empty_split_for_any_target(tile_count: int, target: int) -> None:
    splits = sequence_parallel_splits(tile_count, target=target)
    if tile_count == 0:
        assert splits == 1
        return
    per_split = -(-tile_count // splits)
    assert per_split <= target
    assert per_split * splits >= tile_count
    assert (splits - 1) * per_split < tile_count


def test_no_empty_split_exhaustively_for_small_tile_counts() -> None:
    for count in range(1, 100_000):
        splits = sequence_parallel_splits(count)
        per_split = -(-count // splits)
        assert (splits - 1) * per_split < count <= splits * per_split


# --------------------------------------------------------------------------
# Purity.
# --------------------------------------------------------------------------


def test_import_is_pure() -> None:
    code = (
        "import sys, tuner.planner.seed\n"
        "heavy = [m for m in ('pycuda', 'sqlalchemy', 'optuna', 'torch') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == ""
