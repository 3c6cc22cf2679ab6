"""The tunable planner: a plan that describes the CUDA kernel actually launched.

Two kernel families (``kernels/scalar_online.cu``, ``kernels/tiled.cu``):

* ``scalar_online``: one query row per thread, ``threads`` rows per block, the
  row's scaled query in registers and its output accumulator in shared memory
  (``[head_dim][threads]``, the seed's ``o_acc`` scratch), every key streamed.
* ``tiled``: a block owns ``rows_per_block`` query rows; K and V tiles of
  ``tile_size`` rows are loaded cooperatively into shared memory; the block's
  ``threads`` form ``rows_per_block / rows_per_thread`` row groups of
  ``threads_per_row`` lanes (one warp or less, so row reductions are shuffles).
  Long rows are split over ``sequence_splits`` blocks whose partial
  (max, sum, accumulator) a second kernel merges.

The work partition follows the seed's rules (``tuner.planner.seed``) with the
seed's constant target of 4 tiles per split made a tunable (``split_target``);
at ``rows_per_block=1`` and ``split_target=4`` the partition fields equal the
seed's. The shared-memory formula here and the kernel's layout are one
contract: ``kernels/tiled.cu`` checks the byte count against its own layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.fixed_width import U32_MAX, div_ceil
from tuner.planner.seed import (
    FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT,
    sequence_parallel_splits,
    split_reduce_scratch_elements,
)
from tuner.problem import SUPPORTED_DTYPES, Problem

Family = Literal["scalar_online", "tiled"]
FAMILIES: tuple[Family, ...] = ("scalar_online", "tiled")

F32_BYTES = 4
#: shared-memory rows are padded by 4 floats so that 16-byte loads of
#: consecutive rows fall in different bank groups (row stride % 32 banks == 4).
SHARED_ROW_PAD = 4
#: the smallest tile / row block and scalar block the space offers: never
#: "larger than needed", so tiny sequences keep candidates.
SMALLEST_TILE = 16
SMALLEST_SCALAR_THREADS = 64
#: threads of the split-reduction kernel's blocks (one float4 of output each).
REDUCE_THREADS = 128
#: non-matmul flops per (query, key) pair in the tiled kernel: scale folded into
#: q at load, so max, subtract, exp2, sum, and the mask compare.
TILED_NON_MATMUL_FLOPS_PER_PAIR = 5
#: per row and tile: max merge, exp2 of the correction, rescale of l.
TILED_NON_MATMUL_FLOPS_PER_ROW_TILE = 4


@dataclass(frozen=True, slots=True)
class KernelParams:
    """The tunables of one candidate. ``scalar_online`` uses ``threads`` only."""

    family: Family
    threads: int
    tile_size: int = 1
    rows_per_block: int = 1
    split_target: int = FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT

    def as_dict(self) -> dict[str, int | str]:
        return {
            "family": self.family,
            "threads": self.threads,
            "tile_size": self.tile_size,
            "rows_per_block": self.rows_per_block,
            "split_target": self.split_target,
        }


@dataclass(frozen=True, slots=True)
class ResourceUsage:
    """What the compiler reports for a kernel (``ptxas -v``)."""

    registers: int
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    static_shared_bytes: int = 0
    stack_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """Everything the build, the launch, the cost model and the registry need."""

    problem: Problem
    params: KernelParams
    # Partition (the seed's fields, generalised).
    tile_size: int
    tile_count: int
    sequence_splits: int
    tiles_per_sequence_split: int
    keys_per_sequence_split: int
    split_reduce_scratch_elements: int
    parallel_workgroups_per_row: int
    rows_per_block: int
    # Thread layout inside a block (tiled only; 1 for scalar_online).
    threads_per_row: int
    rows_per_thread: int
    # Launches: the attention kernel, and the split merge when splits > 1.
    launch: Launch
    reduce_launch: Launch | None
    # Work and traffic.
    global_read_bytes: int
    global_write_bytes: int
    matmul_flops: int
    non_matmul_flops: int
    # Occupancy on the device profile (registers taken into account once known).
    blocks_per_sm: int
    occupancy: float
    waves: float
    # Verdict.
    feasible: bool
    reason: str = ""
    resources: ResourceUsage | None = field(default=None)

    @property
    def family(self) -> Family:
        return self.params.family

    @property
    def threads(self) -> int:
        return self.params.threads

    @property
    def global_bytes(self) -> int:
        return self.global_read_bytes + self.global_write_bytes

    @property
    def partial_elements(self) -> int:
        """Floats of split scratch: unnormalised accumulators plus (max, sum) per row."""
        if self.sequence_splits == 1:
            return 0
        p = self.problem
        return p.batch_heads * self.sequence_splits * p.seq_len * (p.head_dim + 2)

    def compile_defines(self) -> dict[str, int]:
        """The compile-time constants of this plan's kernel; the rest are launch arguments.

        ``seq_len`` and the split partition are runtime arguments, so one cubin
        serves every sequence length and split count.
        """
        p = self.problem
        if self.family == "scalar_online":
            return {"HEAD_DIM": p.head_dim, "THREADS": self.threads, "CAUSAL": int(p.causal)}
        return {
            "HEAD_DIM": p.head_dim,
            "TILE_SIZE": self.tile_size,
            "ROWS_PER_BLOCK": self.rows_per_block,
            "THREADS": self.threads,
            "THREADS_PER_ROW": self.threads_per_row,
            "CAUSAL": int(p.causal),
        }

    def key(self) -> str:
        """A name that identifies the candidate within one problem."""
        if self.family == "scalar_online":
            return f"scalar_online/t{self.threads}"
        return (
            f"tiled/b{self.tile_size}/r{self.rows_per_block}/t{self.threads}"
            f"/s{self.sequence_splits}"
        )

    def with_resources(self, usage: ResourceUsage, device: DeviceProfile) -> KernelPlan:
        """This plan re-judged with the compiler's register and spill report."""
        reason = self.reason
        if self.feasible:
            reason = _resource_verdict(usage, self.threads, device)
        blocks_per_sm = _blocks_per_sm(
            self.threads, self.launch.shared_bytes, usage.registers, device
        )
        occupancy, waves = _occupancy_and_waves(self.launch, self.threads, blocks_per_sm, device)
        return replace(
            self,
            resources=usage,
            feasible=self.feasible and not reason,
            reason=reason,
            blocks_per_sm=blocks_per_sm,
            occupancy=occupancy,
            waves=waves,
        )


def _resource_verdict(usage: ResourceUsage, threads: int, device: DeviceProfile) -> str:
    if usage.spill_store_bytes or usage.spill_load_bytes:
        return (
            f"compiler spills registers to local memory ({usage.spill_store_bytes} B stores, "
            f"{usage.spill_load_bytes} B loads)"
        )
    if usage.registers > device.max_registers_per_thread:
        return f"{usage.registers} registers per thread exceed {device.max_registers_per_thread}"
    if _allocated_registers(usage.registers, device) * threads > device.registers_per_block:
        return (
            f"{usage.registers} registers x {threads} threads exceed the "
            f"{device.registers_per_block}-register block file"
        )
    return ""


def _allocated_registers(registers: int, device: DeviceProfile) -> int:
    """Registers a thread really takes: warps allocate in units of 256."""
    per_warp = registers * device.warp_size
    unit = device.register_allocation_unit
    return div_ceil(per_warp, unit) * unit // device.warp_size


def _blocks_per_sm(
    threads: int, shared_bytes: int, registers: int | None, device: DeviceProfile
) -> int:
    limit = min(device.max_blocks_per_sm, device.max_threads_per_sm // max(threads, 1))
    per_block_shared = shared_bytes + device.reserved_shared_memory_per_block
    limit = min(limit, device.shared_memory_per_sm // per_block_shared)
    if registers:
        limit = min(
            limit, device.registers_per_sm // (_allocated_registers(registers, device) * threads)
        )
    return max(limit, 0)


def _occupancy_and_waves(
    launch: Launch, threads: int, blocks_per_sm: int, device: DeviceProfile
) -> tuple[float, float]:
    if blocks_per_sm == 0:
        return 0.0, math.inf
    occupancy = blocks_per_sm * threads / device.max_threads_per_sm
    waves = launch.blocks / (blocks_per_sm * device.sm_count)
    return occupancy, waves


def _checked_u32(value: int, what: str) -> int:
    if value > U32_MAX:
        raise PlanError(f"Fix: {what} overflows u32: {value} > {U32_MAX}.")
    return value


def choose_threads_per_row(
    rows_per_block: int, tile_size: int, threads: int, head_dim: int, warp_size: int = 32
) -> int | None:
    """Lanes that share one query row in the tiled kernel, or None if no layout fits.

    A row group of ``t`` lanes (a power of two, at most a warp, so the row's
    max and sum are warp shuffles) owns ``rows_per_thread = rows_per_block * t
    / threads`` rows; each lane scores ``tile_size / t`` keys and accumulates
    ``head_dim / t`` output columns as float4s. Among the layouts that divide
    evenly, pick the one whose score micro-tile is closest to square (the best
    ratio of FMAs to shared-memory loads), larger ``t`` on ties.
    """
    best: tuple[float, int] | None = None
    lanes = 1
    while lanes <= warp_size:
        row_groups = threads // lanes
        if (
            threads % lanes == 0
            and row_groups > 0
            and rows_per_block % row_groups == 0
            and tile_size % lanes == 0
            and head_dim % (4 * lanes) == 0
        ):
            rows_per_thread = rows_per_block // row_groups
            keys_per_lane = tile_size // lanes
            imbalance = abs(math.log2(rows_per_thread) - math.log2(keys_per_lane))
            if best is None or imbalance <= best[0]:
                best = (imbalance, lanes)
        lanes *= 2
    return None if best is None else best[1]


def tiled_shared_bytes(rows_per_block: int, tile_size: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/tiled.cu``: Q, K, V tiles and the P tile."""
    row = head_dim + SHARED_ROW_PAD
    floats = (rows_per_block + 2 * tile_size) * row + rows_per_block * (
        tile_size + SHARED_ROW_PAD
    )
    return floats * F32_BYTES


def scalar_shared_bytes(threads: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/scalar_online.cu``: the o accumulators."""
    return threads * head_dim * F32_BYTES


def plan_kernel(problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
    """Plan one candidate. Infeasible candidates come back with ``feasible=False``
    and a one-line ``reason``; ``PlanError`` is raised only for a problem that no
    candidate could serve (empty or overflowing dimensions, unknown dtype).
    """
    validate_problem(problem)
    if params.family == "scalar_online":
        return _plan_scalar(problem, params, device)
    if params.family == "tiled":
        return _plan_tiled(problem, params, device)
    raise PlanError(f"unknown kernel family {params.family!r}; known: {', '.join(FAMILIES)}")


def validate_problem(problem: Problem) -> None:
    for name in ("seq_len", "head_dim", "batch", "heads"):
        value = getattr(problem, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{name}={value!r} is invalid: must be an integer")
        if value <= 0:
            raise PlanError(f"{name}={value} is invalid: must be > 0")
        _checked_u32(value, name)
    if problem.dtype not in SUPPORTED_DTYPES:
        raise PlanError(
            f"dtype={problem.dtype!r} is not supported; allowed: {', '.join(SUPPORTED_DTYPES)}"
        )
    _checked_u32(
        problem.batch * problem.heads * problem.seq_len * problem.head_dim,
        f"batch*heads*seq_len*head_dim ({problem.label()}) elements",
    )


def _common_verdict(params: KernelParams, shared_bytes: int, device: DeviceProfile) -> str:
    if params.threads <= 0 or params.threads % device.warp_size:
        return f"threads={params.threads} is not a positive multiple of {device.warp_size}"
    if params.threads > device.max_threads_per_block:
        return (
            f"threads={params.threads} exceeds the {device.max_threads_per_block}-thread "
            "block limit"
        )
    if shared_bytes > device.max_shared_memory_per_block_optin:
        return (
            f"shared memory {shared_bytes} B exceeds the device's per-block opt-in limit "
            f"{device.max_shared_memory_per_block_optin} B"
        )
    return ""


def _plan_scalar(problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
    n, d, bh = problem.seq_len, problem.head_dim, problem.batch_heads
    threads = params.threads
    shared = scalar_shared_bytes(threads, d)
    reason = _common_verdict(params, shared, device)
    if not reason and _larger_than_needed(threads, n, SMALLEST_SCALAR_THREADS):
        reason = f"threads={threads} exceeds what seq_len={n} needs (half the block covers it)"
    row_blocks = div_ceil(n, max(threads, 1))
    launch = Launch(grid=(row_blocks, 1, bh), block=(threads, 1, 1), shared_bytes=shared)
    pairs = problem.attended_pairs
    # Every block streams the keys its rows attend (all of them, or up to its
    # last row when causal) once; the warp-uniform key address is a broadcast.
    key_rows_read = _key_rows_read_per_head(n, threads, problem.causal)
    read = F32_BYTES * bh * (n * d + 2 * key_rows_read * d)
    write = F32_BYTES * bh * n * d
    blocks_per_sm = _blocks_per_sm(threads, shared, None, device)
    occupancy, waves = _occupancy_and_waves(launch, threads, blocks_per_sm, device)
    return KernelPlan(
        problem=problem,
        params=params,
        tile_size=1,
        tile_count=n,
        sequence_splits=1,
        tiles_per_sequence_split=n,
        keys_per_sequence_split=n,
        split_reduce_scratch_elements=0,
        parallel_workgroups_per_row=1,
        rows_per_block=1,
        threads_per_row=1,
        rows_per_thread=1,
        launch=launch,
        reduce_launch=None,
        global_read_bytes=read,
        global_write_bytes=write,
        matmul_flops=problem.useful_flops,
        non_matmul_flops=bh * (pairs * 9 + n * d * 4),
        blocks_per_sm=blocks_per_sm,
        occupancy=occupancy,
        waves=waves,
        feasible=not reason,
        reason=reason,
    )


def _larger_than_needed(size: int, seq_len: int, smallest: int) -> bool:
    """A size is wasteful when half of it already covers the sequence.

    ``smallest`` keeps the smallest useful size feasible for tiny sequences,
    so every problem has at least one candidate of each family.
    """
    return size // 2 >= seq_len and size // 2 >= smallest


def _key_rows_read_per_head(n: int, rows_per_block: int, causal: bool) -> int:
    """Key rows all blocks of one head read: once per block of query rows.

    This is the reuse ``rows_per_block`` buys: K and V cross the memory bus
    once per block, not once per query row.
    """
    blocks = div_ceil(n, rows_per_block)
    if not causal:
        return blocks * n
    # Block b attends keys [0, min(n, (b+1)*rows_per_block)): the first `full`
    # blocks end inside the sequence, the rest (at most one) read all n keys.
    full = n // rows_per_block
    return rows_per_block * full * (full + 1) // 2 + (blocks - full) * n


def _plan_tiled(problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
    n, d, bh = problem.seq_len, problem.head_dim, problem.batch_heads
    tile, rows, threads = params.tile_size, params.rows_per_block, params.threads
    reason = ""
    if tile <= 0 or rows <= 0 or params.split_target <= 0:
        raise PlanError(
            f"tile_size={tile}, rows_per_block={rows}, split_target={params.split_target}: "
            "each must be > 0"
        )
    # The seed's partition, with the split target as a tunable.
    tile_count = div_ceil(n, tile)
    splits = sequence_parallel_splits(tile_count, target=params.split_target)
    tiles_per_split = div_ceil(tile_count, splits)
    keys_per_split = min(_checked_u32(tile * tiles_per_split, "split key span"), n)
    reduce_scratch = split_reduce_scratch_elements(splits, d)
    shared = tiled_shared_bytes(rows, tile, d)
    lanes = choose_threads_per_row(rows, tile, threads, d, device.warp_size)

    if d % 4:
        reason = f"head_dim={d} is not a multiple of 4 (the tiled kernel moves float4s)"
    elif tile % 4:
        reason = f"tile_size={tile} is not a multiple of 4 (P.V reads the P tile as float4s)"
    if not reason:
        reason = _common_verdict(params, shared, device)
    if not reason and _larger_than_needed(tile, n, SMALLEST_TILE):
        reason = f"tile_size={tile} is larger than needed for seq_len={n}"
    if not reason and _larger_than_needed(rows, n, SMALLEST_TILE):
        reason = f"rows_per_block={rows} is larger than needed for seq_len={n}"
    if not reason and lanes is None:
        reason = (
            f"no thread layout: {threads} threads cannot split {rows} rows x {tile} keys x "
            f"{d} columns evenly into row groups of at most a warp"
        )
    lanes = lanes or 1
    row_blocks = div_ceil(n, rows)
    launch = Launch(grid=(row_blocks, splits, bh), block=(threads, 1, 1), shared_bytes=shared)
    reduce_launch = None
    partial = bh * splits * n * (d + 2) if splits > 1 else 0
    if splits > 1:
        reduce_blocks = div_ceil(bh * n * (d // 4 if d % 4 == 0 else d), REDUCE_THREADS)
        reduce_launch = Launch(
            grid=(reduce_blocks, 1, 1), block=(REDUCE_THREADS, 1, 1), shared_bytes=0
        )
    if not reason and partial > U32_MAX:
        reason = f"split scratch of {partial} floats overflows u32"
    if not reason and row_blocks * splits > U32_MAX:
        reason = f"{row_blocks} row blocks x {splits} splits overflow u32"

    key_rows = _key_rows_read_per_head(n, rows, problem.causal)
    read = F32_BYTES * bh * (n * d + 2 * key_rows * d)
    write = F32_BYTES * bh * n * d
    if splits > 1:
        # Partials written by the attention kernel, read back by the merge.
        read += F32_BYTES * partial
        write += F32_BYTES * partial
    pairs = problem.attended_pairs
    non_matmul = bh * (
        pairs * TILED_NON_MATMUL_FLOPS_PER_PAIR
        + n * tile_count * TILED_NON_MATMUL_FLOPS_PER_ROW_TILE
        + n * d * 3
        + n * (splits - 1) * d * 3
    )
    blocks_per_sm = _blocks_per_sm(threads, shared, None, device)
    occupancy, waves = _occupancy_and_waves(launch, threads, blocks_per_sm, device)
    if not reason and blocks_per_sm == 0:
        reason = f"{threads} threads with {shared} B shared memory do not fit on one SM"
    return KernelPlan(
        problem=problem,
        params=params,
        tile_size=tile,
        tile_count=tile_count,
        sequence_splits=splits,
        tiles_per_sequence_split=tiles_per_split,
        keys_per_sequence_split=keys_per_split,
        split_reduce_scratch_elements=reduce_scratch,
        parallel_workgroups_per_row=splits,
        rows_per_block=rows,
        threads_per_row=lanes,
        rows_per_thread=max(rows * lanes // max(threads, 1), 1),
        launch=launch,
        reduce_launch=reduce_launch,
        global_read_bytes=read,
        global_write_bytes=write,
        matmul_flops=problem.useful_flops,
        non_matmul_flops=non_matmul,
        blocks_per_sm=blocks_per_sm,
        occupancy=occupancy,
        waves=waves,
        feasible=not reason,
        reason=reason,
    )
