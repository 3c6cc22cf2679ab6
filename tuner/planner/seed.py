"""Exact Python port of the seed's shared flash-attention planner.

Source: ``/work/shared/seed/flash_attention_planner.rs`` (vyre-libs 0.6.3).

The seed plan is the baseline every tuned plan is compared against, so this
port reproduces it bit for bit: the same u32/u64 arithmetic (checked products
that fail, saturating ones that clamp), the same error texts, and the same
order of checks, so that when several things are wrong the same error wins.
Rust's ``Result<_, String>`` errors are raised as :class:`PlanError`.

The module is pure (stdlib and the planner's own helpers only) so that the
planner can be imported and tested without CUDA, a database or Optuna.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tuner.planner.errors import PlanError
from tuner.planner.fixed_width import (
    U32_MAX,
    checked_add_u32,
    checked_mul_u32,
    checked_mul_u64,
    div_ceil,
    saturating_add_u64,
    saturating_mul_u64,
    saturating_sub_u32,
)

__all__ = [
    "COOPERATIVE_TILED_WORKGROUP_LANES",
    "F32_BYTES",
    "FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS",
    "FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT",
    "SCALAR_ONLINE_WORKGROUP_LANES",
    "WARP_LANES",
    "FlashAttentionBenchMetrics",
    "FlashAttentionKernelKind",
    "FlashAttentionMemoryTraffic",
    "FlashAttentionWorkPlan",
    "occupancy_proxy_bps",
    "plan_flash_attention_scalar",
    "plan_flash_attention_tiled",
    "sequence_parallel_splits",
    "split_reduce_scratch_elements",
]

# Absolute output tolerance used by flash-attention parity checks.
# The seed stores this as ``1.0e-3_f32``, which widens to 0.0010000000474974513
# as a double. We keep the documented decimal value: parity checks compare
# float32 outputs with it, and the f32 rounding (about 5e-11) is far below any
# difference those checks can resolve.
FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS: float = 1e-3

# Target number of KV tiles handled by one sequence-parallel split.
FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT: int = 4

SCALAR_ONLINE_WORKGROUP_LANES: int = 128
COOPERATIVE_TILED_WORKGROUP_LANES: int = 64
WARP_LANES: int = 32
F32_BYTES: int = 4  # core::mem::size_of::<f32>() as u64


class FlashAttentionKernelKind(enum.Enum):
    """Flash-attention kernel family selected by the planner."""

    # One query row per invocation, key rows processed scalar online.
    SCALAR_ONLINE = "ScalarOnline"
    # One query row per invocation, key rows processed in cooperative tiles.
    COOPERATIVE_TILED = "CooperativeTiled"


@dataclass(frozen=True, slots=True)
class FlashAttentionMemoryTraffic:
    """Estimated memory traffic (bytes, u64, saturating) for a work plan."""

    global_read_bytes: int
    global_write_bytes: int
    shared_memory_bytes: int


@dataclass(frozen=True, slots=True)
class FlashAttentionBenchMetrics:
    """Benchmark evidence recorded with every planner row."""

    output_tolerance_abs: float
    memory_traffic: FlashAttentionMemoryTraffic
    occupancy_proxy_bps: int  # u32: active lanes per workgroup, in basis points
    non_matmul_flops: int  # u64, saturating


@dataclass(frozen=True, slots=True)
class FlashAttentionWorkPlan:
    """Shared work partition for flash-attention variants (fields as in the seed)."""

    kernel: FlashAttentionKernelKind
    seq_len: int
    head_dim: int
    tile_size: int  # KV tile size; scalar online uses 1
    tile_count: int
    sequence_splits: int  # sequence-parallel partial rows per query row
    tiles_per_sequence_split: int  # max KV tiles in one split
    keys_per_sequence_split: int  # max KV rows in one split
    rows_per_block: int
    parallel_workgroups_per_row: int
    workgroup_lanes: int
    warp_lanes: int
    warps_per_block: int
    logical_elements: int  # elements in each q/k/v/out matrix
    q_scratch_elements: int
    score_scratch_elements: int
    o_acc_scratch_elements: int
    split_reduce_scratch_elements: int
    bench_metrics: FlashAttentionBenchMetrics


def _require_u32(name: str, value: object) -> int:
    """Reject what Rust's ``u32`` parameter type would have rejected at compile time.

    Python ints are unbounded and bools/floats pass for numbers, so without
    this a negative or oversized value would silently plan something the seed
    can never plan.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(
            f"Fix: {name}={value!r} must fit u32: an int in 0..={U32_MAX}, "
            f"not {type(value).__name__}."
        )
    if value < 0 or value > U32_MAX:
        raise PlanError(f"Fix: {name}={value} must fit u32: an int in 0..={U32_MAX}.")
    return value


def plan_flash_attention_scalar(seq_len: int, head_dim: int) -> FlashAttentionWorkPlan:
    """Plan the scalar online-softmax flash-attention baseline.

    Raises :class:`PlanError` when dimensions are empty or overflow.
    """
    seq_len = _require_u32("seq_len", seq_len)
    head_dim = _require_u32("head_dim", head_dim)
    logical_elements = _validate_attention_dims("flash_attention", seq_len, head_dim)
    q_scratch_elements = _checked_mul(
        SCALAR_ONLINE_WORKGROUP_LANES, head_dim, "flash_attention q/o scratch"
    )
    memory_traffic = _scalar_memory_traffic(seq_len, head_dim, q_scratch_elements)
    return FlashAttentionWorkPlan(
        kernel=FlashAttentionKernelKind.SCALAR_ONLINE,
        seq_len=seq_len,
        head_dim=head_dim,
        tile_size=1,
        tile_count=seq_len,
        sequence_splits=1,
        tiles_per_sequence_split=seq_len,
        keys_per_sequence_split=seq_len,
        rows_per_block=1,
        parallel_workgroups_per_row=1,
        workgroup_lanes=SCALAR_ONLINE_WORKGROUP_LANES,
        warp_lanes=WARP_LANES,
        warps_per_block=SCALAR_ONLINE_WORKGROUP_LANES // WARP_LANES,
        logical_elements=logical_elements,
        q_scratch_elements=q_scratch_elements,
        score_scratch_elements=0,
        o_acc_scratch_elements=q_scratch_elements,
        split_reduce_scratch_elements=0,
        bench_metrics=FlashAttentionBenchMetrics(
            output_tolerance_abs=FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS,
            memory_traffic=memory_traffic,
            occupancy_proxy_bps=occupancy_proxy_bps(
                max(head_dim, 1), SCALAR_ONLINE_WORKGROUP_LANES
            ),
            non_matmul_flops=_scalar_non_matmul_flops(seq_len, head_dim),
        ),
    )


def plan_flash_attention_tiled(
    seq_len: int, head_dim: int, tile_size: int
) -> FlashAttentionWorkPlan:
    """Plan cooperative tiled FlashAttention-2-style execution.

    Raises :class:`PlanError` when dimensions are empty or overflow. Checks run
    in the seed's order: dims, tile_size, split key span, q/score/o scratch,
    split reduction scratch, shared scratch sum.
    """
    seq_len = _require_u32("seq_len", seq_len)
    head_dim = _require_u32("head_dim", head_dim)
    tile_size = _require_u32("tile_size", tile_size)
    logical_elements = _validate_attention_dims("flash_attention_2", seq_len, head_dim)
    if tile_size == 0:
        raise PlanError("Fix: flash_attention_2 tile_size must be > 0")
    tile_count = div_ceil(seq_len, tile_size)
    sequence_splits = sequence_parallel_splits(tile_count)
    tiles_per_sequence_split = div_ceil(tile_count, sequence_splits)
    key_span = checked_mul_u32(tile_size, tiles_per_sequence_split)
    if key_span is None:
        raise PlanError("Fix: flash_attention_2 split key span overflows u32")
    keys_per_sequence_split = min(key_span, seq_len)
    q_scratch_elements = _checked_mul(
        COOPERATIVE_TILED_WORKGROUP_LANES, head_dim, "flash_attention_2 q_scratch"
    )
    score_scratch_elements = _checked_mul(
        COOPERATIVE_TILED_WORKGROUP_LANES, tile_size, "flash_attention_2 score_scratch"
    )
    o_acc_scratch_elements = _checked_mul(
        COOPERATIVE_TILED_WORKGROUP_LANES, head_dim, "flash_attention_2 o_acc"
    )
    split_reduce = split_reduce_scratch_elements(sequence_splits, head_dim)
    # checked_add(..).and_then(checked_add ..).and_then(checked_add ..)
    shared_elements = checked_add_u32(q_scratch_elements, score_scratch_elements)
    if shared_elements is not None:
        shared_elements = checked_add_u32(shared_elements, o_acc_scratch_elements)
    if shared_elements is not None:
        shared_elements = checked_add_u32(shared_elements, split_reduce)
    if shared_elements is None:
        raise PlanError("Fix: flash_attention_2 shared scratch overflows u32")
    memory_traffic = _tiled_memory_traffic(seq_len, head_dim, shared_elements)
    return FlashAttentionWorkPlan(
        kernel=FlashAttentionKernelKind.COOPERATIVE_TILED,
        seq_len=seq_len,
        head_dim=head_dim,
        tile_size=tile_size,
        tile_count=tile_count,
        sequence_splits=sequence_splits,
        tiles_per_sequence_split=tiles_per_sequence_split,
        keys_per_sequence_split=keys_per_sequence_split,
        rows_per_block=1,
        parallel_workgroups_per_row=sequence_splits,
        workgroup_lanes=COOPERATIVE_TILED_WORKGROUP_LANES,
        warp_lanes=WARP_LANES,
        warps_per_block=COOPERATIVE_TILED_WORKGROUP_LANES // WARP_LANES,
        logical_elements=logical_elements,
        q_scratch_elements=q_scratch_elements,
        score_scratch_elements=score_scratch_elements,
        o_acc_scratch_elements=o_acc_scratch_elements,
        split_reduce_scratch_elements=split_reduce,
        bench_metrics=FlashAttentionBenchMetrics(
            output_tolerance_abs=FLASH_ATTENTION_OUTPUT_TOLERANCE_ABS,
            memory_traffic=memory_traffic,
            occupancy_proxy_bps=occupancy_proxy_bps(
                max(head_dim, tile_size), COOPERATIVE_TILED_WORKGROUP_LANES
            ),
            non_matmul_flops=_tiled_non_matmul_flops(
                seq_len, head_dim, tile_count, sequence_splits
            ),
        ),
    )


def sequence_parallel_splits(
    tile_count: int,
    target: int = FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT,
) -> int:
    """Number of sequence-parallel splits: ``max(1, ceil(tile_count / target))``.

    ``target`` generalises the seed's constant so the tunable planner can
    search it; the default is the seed's rule. A zero target would divide by
    zero (a panic in Rust), so it is refused as a :class:`PlanError`.
    """
    tile_count = _require_u32("tile_count", tile_count)
    target = _require_u32("target", target)
    if target == 0:
        raise PlanError("Fix: sequence-parallel target tiles per split must be > 0")
    return max(div_ceil(tile_count, target), 1)


def split_reduce_scratch_elements(sequence_splits: int, head_dim: int) -> int:
    """Scratch for the partial softmax state: ``sequence_splits * (head_dim + 2)``.

    Each split keeps its partial output row plus the running max and sum.
    """
    sequence_splits = _require_u32("sequence_splits", sequence_splits)
    head_dim = _require_u32("head_dim", head_dim)
    softmax_scalars = checked_add_u32(head_dim, 2)
    if softmax_scalars is None:
        raise PlanError("Fix: flash_attention_2 split reduction state overflows u32")
    return _checked_mul(
        sequence_splits, softmax_scalars, "flash_attention_2 split reduction scratch"
    )


def _validate_attention_dims(context: str, seq_len: int, head_dim: int) -> int:
    """Refuse empty dimensions, then return ``seq_len * head_dim`` checked in u32."""
    if seq_len == 0:
        raise PlanError(f"{context} seq_len=0 is invalid: empty sequence")
    if head_dim == 0:
        raise PlanError(f"{context} head_dim=0 is invalid: empty head dimension")
    return _checked_mul(seq_len, head_dim, context)


def _checked_mul(lhs: int, rhs: int, context: str) -> int:
    """u32 ``checked_mul`` with the seed's fix-directed overflow message."""
    product = checked_mul_u32(lhs, rhs)
    if product is None:
        raise PlanError(f"Fix: {context} dimensions overflow u32: {lhs}*{rhs}.")
    return product


def _scalar_memory_traffic(
    seq_len: int, head_dim: int, scratch_elements: int
) -> FlashAttentionMemoryTraffic:
    """Scalar baseline: every query row re-reads K and V (and Q) per key."""
    pair_elements = _square_times_dim(seq_len, head_dim, "flash_attention scalar traffic")
    output_elements = seq_len * head_dim  # u32*u32 always fits u64
    return FlashAttentionMemoryTraffic(
        global_read_bytes=saturating_mul_u64(saturating_mul_u64(pair_elements, 3), F32_BYTES),
        global_write_bytes=saturating_mul_u64(output_elements, F32_BYTES),
        shared_memory_bytes=saturating_mul_u64(scratch_elements, F32_BYTES),
    )


def _tiled_memory_traffic(
    seq_len: int, head_dim: int, shared_elements: int
) -> FlashAttentionMemoryTraffic:
    """Tiled: K and V per key pair, Q once per row."""
    pair_elements = _square_times_dim(seq_len, head_dim, "flash_attention tiled traffic")
    row_elements = seq_len * head_dim  # u32*u32 always fits u64
    read = saturating_add_u64(saturating_mul_u64(pair_elements, 2), row_elements)
    return FlashAttentionMemoryTraffic(
        global_read_bytes=saturating_mul_u64(read, F32_BYTES),
        global_write_bytes=saturating_mul_u64(row_elements, F32_BYTES),
        shared_memory_bytes=saturating_mul_u64(shared_elements, F32_BYTES),
    )


def _square_times_dim(seq_len: int, head_dim: int, context: str) -> int:
    """``seq_len^2 * head_dim`` checked in u64.

    Unreachable from the planners (seq_len*head_dim already fits u32, so the
    result is below 2**64) but kept for fidelity.
    """
    square = checked_mul_u64(seq_len, seq_len)
    if square is None:
        raise PlanError(f"Fix: {context} seq_len^2 overflows u64.")
    product = checked_mul_u64(square, head_dim)
    if product is None:
        raise PlanError(f"Fix: {context} seq_len^2*head_dim overflows u64.")
    return product


def occupancy_proxy_bps(active_lanes: int, workgroup_lanes: int) -> int:
    """Active lanes per workgroup in basis points, clamped to ``1..=workgroup_lanes``.

    The seed ends with ``as u32``, which truncates; the quotient is at most
    10_000 so the mask never changes anything, but it mirrors the cast.
    """
    if workgroup_lanes == 0:
        return 0
    active = max(min(active_lanes, workgroup_lanes), 1)
    return ((active * 10_000) // workgroup_lanes) & U32_MAX


def _scalar_non_matmul_flops(seq_len: int, head_dim: int) -> int:
    """Scalar softmax/rescale work: 9 ops per (query, key) pair, 4 per output value."""
    pairs = seq_len * seq_len
    row_values = seq_len * head_dim
    return saturating_add_u64(saturating_mul_u64(pairs, 9), saturating_mul_u64(row_values, 4))


def _tiled_non_matmul_flops(
    seq_len: int, head_dim: int, tile_count: int, sequence_splits: int
) -> int:
    """Tiled softmax work plus per-tile rescales and the cross-split reduction.

    The seed's plain (non-saturating) u64 products of u32 values are kept as
    plain products: for u32 inputs with ``seq_len*head_dim`` in u32 they are
    below 2**64.
    """
    pairs = seq_len * seq_len
    row_values = seq_len * head_dim
    tile_updates = seq_len * tile_count
    split_reduce_values = seq_len * saturating_sub_u32(sequence_splits, 1) * head_dim
    total = saturating_mul_u64(pairs, 4)
    total = saturating_add_u64(total, saturating_mul_u64(tile_updates, 8))
    total = saturating_add_u64(total, saturating_mul_u64(row_values, 3))
    return saturating_add_u64(total, saturating_mul_u64(split_reduce_values, 3))
