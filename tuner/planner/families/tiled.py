"""``tiled`` (``kernels/tiled.cu``): the seed's CooperativeTiled family, FlashAttention-2 style.

A block owns ``rows_per_block`` query rows; K and V tiles of ``tile_size``
rows are loaded cooperatively into shared memory; the block's ``threads``
form ``rows_per_block / rows_per_thread`` row groups of ``threads_per_row``
lanes (one warp or less, so row reductions are shuffles). Long rows are split
over ``sequence_splits`` blocks whose partial (max, sum, accumulator)
``split_merge`` combines. float32 only.

The work partition follows the seed's rules (``tuner.planner.seed``) with the
seed's constant target of 4 tiles per split made a tunable (``split_target``);
at ``rows_per_block=1`` and ``split_target=4`` the partition fields equal the
seed's. The shared-memory formula here and the kernel's layout are one
contract: ``kernels/tiled.cu`` checks the byte count against its own layout.
"""

from __future__ import annotations

import math

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.families.base import (
    MERGE_THREADS,
    CostTerms,
    KernelFamily,
    Tunable,
    checked_u32,
    executed_pairs,
    float4_merge_launch,
    larger_than_needed,
    launch_verdict,
    split_kv_launches,
)
from tuner.planner.fixed_width import U32_MAX, div_ceil
from tuner.planner.key_span import span_tiles, visible_keys_read_per_head
from tuner.planner.launches import DeviceBuffers, KernelLaunch
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.planner.seed import (
    FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT,
    sequence_parallel_splits,
    split_reduce_scratch_elements,
)
from tuner.problem import Problem

F32_BYTES = 4
#: shared-memory rows are padded by 4 floats so that 16-byte loads of
#: consecutive rows fall in different bank groups (row stride % 32 banks == 4).
SHARED_ROW_PAD = 4
#: the smallest tile / row block the space offers: never "larger than needed",
#: so tiny sequences keep candidates.
SMALLEST_TILE = 16
#: threads of the split merge's blocks (the shared merge: one float4 of output each).
REDUCE_THREADS = MERGE_THREADS
#: non-matmul flops per (query, key) pair: scale folded into q at load, so
#: max, subtract, exp2, sum, and the mask compare.
TILED_NON_MATMUL_FLOPS_PER_PAIR = 5
#: per row and tile: max merge, exp2 of the correction, rescale of l.
TILED_NON_MATMUL_FLOPS_PER_ROW_TILE = 4
#: tiles per split; the largest values mean "no split" for any sequence up to 2**20 keys.
DEFAULT_SPLIT_TARGETS: tuple[int, ...] = tuple(2**k for k in range(0, 17))


def choose_threads_per_row(
    rows_per_block: int, tile_size: int, threads: int, head_dim: int, warp_size: int = 32
) -> int | None:
    """Lanes that share one query row, or None if no layout fits.

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
    floats = (rows_per_block + 2 * tile_size) * row + rows_per_block * (tile_size + SHARED_ROW_PAD)
    return floats * F32_BYTES


class Tiled(KernelFamily):
    takes_variants = False  # a SIMT family: the variants run on the tensor-core ones
    name = "tiled"
    source = "tiled.cu"
    entry_functions = ("tiled_attention", "split_merge")
    dtypes = ("float32",)
    tunables = (
        Tunable("threads", 128, (64, 128, 256, 512), axis="tiled_threads", sampler="threads"),
        Tunable("tile_size", 1, (16, 32, 64, 128), axis="tile_sizes", sampler="tile_size"),
        Tunable(
            "rows_per_block", 1, (16, 32, 64, 128), axis="rows_per_block", sampler="rows_per_block"
        ),
        Tunable(
            "split_target",
            FLASH_ATTENTION_SEQUENCE_PARALLEL_TARGET_TILES_PER_SPLIT,
            DEFAULT_SPLIT_TARGETS,
            axis="split_targets",
            sampler="split_target",
        ),
    )
    enumeration_order = ("tile_size", "rows_per_block", "threads", "split_target")
    heatmap_axes = ("tile_size", "rows_per_block")

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d, bh = problem.seq_len, problem.head_dim, problem.batch_heads
        tile, rows, threads = params.tile_size, params.rows_per_block, params.threads
        target = params.split_target
        reason = ""
        if tile <= 0 or rows <= 0 or target <= 0:
            raise PlanError(
                f"tile_size={tile}, rows_per_block={rows}, split_target={target}: each must be > 0"
            )
        # The seed's partition, with the split target as a tunable.
        kv_len = problem.kv_len
        tile_count = span_tiles(problem, tile)
        splits = sequence_parallel_splits(tile_count, target=target)
        tiles_per_split = div_ceil(tile_count, splits)
        keys_per_split = min(checked_u32(tile * tiles_per_split, "split key span"), kv_len)
        reduce_scratch = split_reduce_scratch_elements(splits, d)
        shared = tiled_shared_bytes(rows, tile, d)
        lanes = choose_threads_per_row(rows, tile, threads, d, device.warp_size)

        if d % 4:
            reason = f"head_dim={d} is not a multiple of 4 (the tiled kernel moves float4s)"
        elif tile % 4:
            reason = f"tile_size={tile} is not a multiple of 4 (P.V reads the P tile as float4s)"
        if not reason:
            reason = self.variant_verdict(problem) or launch_verdict(threads, shared, device)
        if not reason and larger_than_needed(tile, kv_len, SMALLEST_TILE):
            reason = f"tile_size={tile} is larger than needed for kv_len={kv_len}"
        if not reason and larger_than_needed(rows, n, SMALLEST_TILE):
            reason = f"rows_per_block={rows} is larger than needed for seq_len={n}"
        if not reason and lanes is None:
            reason = (
                f"no thread layout: {threads} threads cannot split {rows} rows x {tile} keys x "
                f"{d} columns evenly into row groups of at most a warp"
            )
        lanes = lanes or 1
        row_blocks = div_ceil(n, rows)
        launch = Launch(grid=(row_blocks, splits, bh), block=(threads, 1, 1), shared_bytes=shared)
        reduce_launch = float4_merge_launch(bh, n, d, splits)
        partial = bh * splits * n * (d + 1) if splits > 1 else 0
        if not reason and partial > U32_MAX:
            reason = f"split scratch of {partial} floats overflows u32"
        if not reason and row_blocks * splits > U32_MAX:
            reason = f"{row_blocks} row blocks x {splits} splits overflow u32"

        element = problem.element_bytes
        # Each query head's blocks read its KV head: a group's heads share K/V only in L2.
        key_rows = visible_keys_read_per_head(problem, rows, tile)
        read = element * bh * (n * d + 2 * key_rows * d)
        write = element * bh * n * d
        if splits > 1:
            # Partials (float32) written by the attention kernel, read back by the merge.
            read += F32_BYTES * partial
            write += F32_BYTES * partial
        pairs = problem.attended_pairs
        non_matmul = bh * (
            pairs * TILED_NON_MATMUL_FLOPS_PER_PAIR
            + n * tile_count * TILED_NON_MATMUL_FLOPS_PER_ROW_TILE
            + n * d * 3
            + n * (splits - 1) * d * 3
        )
        blocks_per_sm = blocks_per_sm_of(threads, shared, None, device)
        occupancy, waves = occupancy_and_waves(launch, threads, blocks_per_sm, device)
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

    def compile_defines(self, plan: KernelPlan) -> dict[str, int]:
        # seq_len and the split partition are launch arguments, so one cubin
        # serves every sequence length and split count.
        p = plan.problem
        return {
            "HEAD_DIM": p.head_dim,
            "TILE_SIZE": plan.tile_size,
            "ROWS_PER_BLOCK": plan.rows_per_block,
            "THREADS": plan.threads,
            "THREADS_PER_ROW": plan.threads_per_row,
            "CAUSAL": int(p.causal),
        }

    def key(self, plan: KernelPlan) -> str:
        # ``s`` is the plan's sequence_splits (what split_target leads to); the
        # recorded replays and existing studies are keyed by this spelling.
        return (
            f"tiled/b{plan.tile_size}/r{plan.rows_per_block}/t{plan.threads}"
            f"/s{plan.sequence_splits}"
        )

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        if plan.launch.grid[1] != plan.sequence_splits:
            # The kernel tells one split from several by gridDim.y.
            raise ValueError(
                f"{plan.key()}: grid {plan.launch.grid} does not launch one column per split"
            )
        return split_kv_launches(plan, buffers, "tiled_attention", "split_merge")

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """Shared traffic per K/V tile: a thread reads its ``rows_per_thread`` Q rows and
        ``keys_per_lane`` K rows (``head_dim`` floats each), writes its P scores, then
        reads its P rows and ``tile_size`` V rows of its ``head_dim / threads_per_row``
        columns; the block also stores the K and V tiles. Bytes count broadcasts once
        per warp (what the banks serve); instructions count per lane. A larger register
        micro-tile needs fewer loads per FFMA: this ranks thread layouts whose flops and
        traffic are equal.
        """
        d, bh, n = plan.problem.head_dim, plan.problem.batch_heads, plan.problem.seq_len
        executed = executed_pairs(plan, plan.rows_per_block)
        tile = plan.tile_size
        lanes = plan.threads_per_row
        rows_per_thread = plan.rows_per_thread
        keys_per_lane = tile // lanes
        row_groups_per_warp = 32 // lanes
        # Per warp and tile: Q and P rows are shared by a row group's lanes, K and V
        # rows by every row group of the warp; the P stores are all distinct.
        q_reads = row_groups_per_warp * rows_per_thread * d
        k_reads = tile * d
        p_writes = 32 * rows_per_thread * keys_per_lane
        p_reads = row_groups_per_warp * rows_per_thread * tile
        v_reads = tile * d
        per_warp = q_reads + k_reads + p_writes + p_reads + v_reads
        per_block = per_warp * (plan.threads // 32) + 2 * tile * d  # + the K/V tile stores
        # Per thread and tile, in instructions: float4 loads of Q, K, P and V
        # columns, scalar P stores; per block the K/V tile copy (load + store).
        per_thread = (
            rows_per_thread * d // 4
            + keys_per_lane * d // 4
            + rows_per_thread * keys_per_lane
            + rows_per_thread * tile // 4
            + tile * d // (4 * lanes)
        )
        per_block_ops = per_thread * plan.threads + 2 * 2 * tile * d // 4
        # Blocks x tiles each block visits = executed pairs / (rows_per_block x tile).
        block_tiles = executed // (plan.rows_per_block * tile)
        return CostTerms(
            matmul_pipe="ffma",
            executed_pairs=executed,
            # p per pair, plus the per-tile correction of every row
            exps=bh * executed + bh * n * plan.tile_count,
            shared_bytes=F32_BYTES * per_block * block_tiles * bh,
            shared_lane_ops=per_block_ops * block_tiles * bh,
            ilp=rows_per_thread * (tile // lanes),
            # A tile of K and V is loaded, then the block waits at its barrier.
            bytes_in_flight=2 * tile * d * plan.problem.element_bytes,
        )


FAMILY = Tiled()
