"""``decode_f16`` (``kernels/decode_f16.cu``): FlashDecoding on tensor cores, bf16/fp16.

For a few query rows (``seq_len`` up to ``MAX_QUERY_ROWS``) against a long KV
cache. One block owns one KV head of one batch and one of ``splits`` ranges of
the keys; the query rows of every query head sharing that KV head are packed
into its ``16 * m_tiles`` rows (``group * seq_len`` rows in all, in row blocks
of that size), so the mma m16 tile is filled by the group instead of by one
head's single row, and K and V are read from DRAM once per (KV head, split,
row block) whatever the group size. K/V tiles of ``block_n`` keys stream
through a ``stages``-deep ``cp.async`` ring; each of the ``warps`` warps
scores ``block_n / warps`` keys of a tile with its own online softmax, the
warps merge through shared memory at the end, and several splits are merged
by ``decode_f16_split_merge`` (the contract of ``mma_f16_split_merge``).

``splits`` is tuned directly (the search chooses it): a split covers whole
tiles, and a count that would leave a split without keys is rejected, so every
candidate is a distinct launch.

The shared-memory formula here and the kernel's layout are one contract (see
the head of ``kernels/decode_f16.cu``).
"""

from __future__ import annotations

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.families.base import (
    CostTerms,
    KernelFamily,
    Tunable,
    checked_u32,
    float4_merge_launch,
    larger_than_needed,
    launch_verdict,
    split_kv_launches,
    variant_defines,
    variant_sfu_ops,
)
from tuner.planner.fixed_width import U32_MAX, div_ceil
from tuner.planner.key_span import key_span
from tuner.planner.launches import DeviceBuffers, KernelLaunch
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.problem import Problem

ELEMENT_BYTES = 2
F32_BYTES = 4
#: 16-byte pad per shared row: conflict-free ldmatrix (as in mma_f16)
SHARED_ROW_PAD = 8
#: float pad per row of the warps' merge scratch
MERGE_ROW_PAD = 4
MMA_M, MMA_K = 16, 16
MAX_HEAD_DIM = 256
#: the query lengths this family serves; longer queries are prefill (mma_f16)
MAX_QUERY_ROWS = 16
GRID_YZ_LIMIT = 65535
#: non-matmul work per executed (row, key) pair: scaled subtract, max, sum, pack, exp2
NON_MATMUL_FLOPS_PER_PAIR = 5
SPLIT_COUNTS: tuple[int, ...] = tuple(2**k for k in range(0, 10))


def decode_f16_shared_bytes(rows: int, block_n: int, stages: int, warps: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/decode_f16.cu``: Q's packed rows, then the K/V
    ring, which the warps' float32 merge scratch reuses after the key loop."""
    row_bytes = ELEMENT_BYTES * (head_dim + SHARED_ROW_PAD)
    ring = row_bytes * 2 * stages * block_n
    merge = F32_BYTES * warps * rows * (head_dim + MERGE_ROW_PAD)
    return row_bytes * rows + max(ring, merge)


def split_partition(span: int, block_n: int, splits: int) -> tuple[int, int]:
    """(keys per split, splits that hold keys): ``splits`` ranges of whole tiles over the
    ``span`` keys the rows see (``kv_len``, or a window's band: ``tuner.planner.key_span``)."""
    tiles = max(1, div_ceil(span, block_n))
    keys_per_split = div_ceil(tiles, splits) * block_n
    return keys_per_split, max(1, div_ceil(span, keys_per_split))


class DecodeF16(KernelFamily):
    name = "decode_f16"
    source = "decode_f16.cu"
    entry_functions = ("decode_f16_attention", "decode_f16_split_merge")
    dtypes = ("bfloat16", "float16")
    tunables = (
        Tunable("block_n", 64, (32, 64, 128, 256)),
        Tunable("warps", 4, (2, 4, 8)),
        Tunable("stages", 4, (2, 3, 4, 6)),
        Tunable("m_tiles", 1, (1, 2)),
        Tunable("splits", 16, SPLIT_COUNTS),
    )
    heatmap_axes = ("block_n", "splits")

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d, m = problem.seq_len, problem.head_dim, problem.kv_len
        bh, bkv, group = problem.batch_heads, problem.batch_kv_heads, problem.group
        block_n, warps, stages = params.block_n, params.warps, params.stages
        m_tiles, splits_asked = params.m_tiles, params.splits
        if min(block_n, warps, stages, m_tiles, splits_asked) <= 0:
            raise PlanError(
                f"block_n={block_n}, warps={warps}, stages={stages}, m_tiles={m_tiles}, "
                f"splits={splits_asked}: each must be > 0"
            )
        rows = MMA_M * m_tiles
        packed_rows = group * n
        row_blocks = div_ceil(packed_rows, rows)
        threads = warps * device.warp_size
        base, end = key_span(problem)
        span = end - base  # keys the rows see: every block reads all of them
        tile_count = max(1, div_ceil(span, block_n))
        keys_per_split, splits = split_partition(span, block_n, splits_asked)
        keys_per_split = checked_u32(keys_per_split, "split key span")
        shared = decode_f16_shared_bytes(rows, block_n, stages, warps, d)
        keys_per_warp = block_n // warps if block_n % warps == 0 else 0

        reason = ""
        if problem.dtype not in self.dtypes:
            reason = f"dtype {problem.dtype} is not one of {', '.join(self.dtypes)}"
        elif n > MAX_QUERY_ROWS:
            reason = (
                f"seq_len={n} query rows: decode_f16 serves up to {MAX_QUERY_ROWS} "
                "(longer queries are prefill)"
            )
        elif d % MMA_K or d > MAX_HEAD_DIM:
            reason = f"head_dim={d} is not a multiple of {MMA_K} up to {MAX_HEAD_DIM}"
        elif m_tiles not in (1, 2):
            reason = f"m_tiles={m_tiles}: a block packs 16 or 32 query rows"
        elif keys_per_warp % MMA_K or keys_per_warp == 0:
            reason = f"block_n={block_n} over {warps} warps is not whole k16 steps a warp"
        elif stages < 2:
            reason = f"stages={stages}: the cp.async ring needs at least 2"
        if not reason:
            reason = self.variant_verdict(problem) or launch_verdict(threads, shared, device)
        if not reason and m_tiles > 1 and packed_rows <= MMA_M:
            reason = (
                f"m_tiles={m_tiles} is larger than needed for {packed_rows} packed rows "
                f"({group} heads x {n} rows)"
            )
        if not reason and larger_than_needed(block_n, m, 32):
            reason = f"block_n={block_n} is larger than needed for kv_len={m}"
        if not reason and splits < splits_asked:
            reason = (
                f"splits={splits_asked} leaves splits without keys: {span} visible keys in "
                f"tiles of {block_n} fill {splits}"
            )
        if not reason and (splits > GRID_YZ_LIMIT or bkv > GRID_YZ_LIMIT):
            reason = f"{splits} splits x {bkv} batch-KV-heads exceed the grid's y/z limit"
        partial = bh * splits * n * (d + 1) if splits > 1 else 0
        if not reason and partial > U32_MAX:
            reason = f"split scratch of {partial} floats overflows u32"

        launch = Launch(grid=(row_blocks, splits, bkv), block=(threads, 1, 1), shared_bytes=shared)
        reduce_launch = float4_merge_launch(bh, n, d, splits)
        element = problem.element_bytes
        # K and V cross DRAM once per (KV head, split, row block): the group shares them.
        read = element * (bh * n * d + 2 * bkv * row_blocks * span * d)
        write = element * bh * n * d
        if splits > 1:
            read += F32_BYTES * partial
            write += F32_BYTES * partial
        executed_rows = row_blocks * rows  # per KV head, padding included
        non_matmul = (
            bkv
            * executed_rows
            * (tile_count * block_n * NON_MATMUL_FLOPS_PER_PAIR + tile_count * (d + 4))
            + bh * n * (splits - 1) * d * 3
        )
        blocks_per_sm = blocks_per_sm_of(threads, shared, None, device)
        occupancy, waves = occupancy_and_waves(launch, threads, blocks_per_sm, device)
        if not reason and blocks_per_sm == 0:
            reason = f"{threads} threads with {shared} B shared memory do not fit on one SM"
        return KernelPlan(
            problem=problem,
            params=params,
            tile_size=block_n,
            tile_count=tile_count,
            sequence_splits=splits,
            tiles_per_sequence_split=keys_per_split // block_n,
            keys_per_sequence_split=keys_per_split,
            split_reduce_scratch_elements=bh * splits * n * d if splits > 1 else 0,
            parallel_workgroups_per_row=splits,
            rows_per_block=rows,
            threads_per_row=4,  # an mma row's scores live in a quad of lanes
            rows_per_thread=max(rows // 8 // warps, 1),
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
        p, params = plan.problem, plan.params
        return {
            "HEAD_DIM": p.head_dim,
            "BLOCK_N": params.block_n,
            "WARPS": params.warps,
            "STAGES": params.stages,
            "M_TILES": params.m_tiles,
            "CAUSAL": int(p.causal),
            "IS_FP16": int(p.dtype == "float16"),
            **variant_defines(p),
        }

    def key(self, plan: KernelPlan) -> str:
        params = plan.params
        return (
            f"decode_f16/n{params.block_n}/w{params.warps}/st{params.stages}"
            f"/m{MMA_M * params.m_tiles}/s{plan.sequence_splits}"
        )

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        return split_kv_launches(plan, buffers, "decode_f16_attention", "decode_f16_split_merge")

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """Per tile and block: the cp.async stores of K and V, every warp's ldmatrix reads
        of its K and V slices and of the block's Q rows (re-read per k16 step). Pairs
        are per query head: a block's padded rows are shared by the group's heads."""
        p, params = plan.problem, plan.params
        d, m_tiles = p.head_dim, params.m_tiles
        rows = plan.rows_per_block
        row_blocks = plan.launch.grid[0]
        padded_keys = plan.tile_count * params.block_n
        tiles = plan.tile_count * row_blocks * p.batch_kv_heads
        per_tile = 2 * 2 * params.block_n * d + params.warps * rows * d  # elements
        cp_async_ops = 2 * params.block_n * d * ELEMENT_BYTES // 16
        ldmatrix_bytes = (2 * params.block_n * d + params.warps * rows * d) * ELEMENT_BYTES
        ldmatrix_ops = ldmatrix_bytes // 512 * 32
        executed = div_ceil(row_blocks * rows * padded_keys, p.group)
        keys_per_warp = params.block_n // params.warps
        return CostTerms(
            matmul_pipe="mma_sync_f16",
            executed_pairs=executed,
            exps=p.batch_kv_heads
            * row_blocks
            * rows
            * (padded_keys + plan.tile_count + variant_sfu_ops(p, padded_keys)),
            shared_bytes=ELEMENT_BYTES * per_tile * tiles,
            shared_lane_ops=(cp_async_ops + ldmatrix_ops) * tiles,
            ilp=m_tiles * (keys_per_warp // 8) + d // 8,
            # The ring prefetches stages - 1 (K, V) tile pairs while one is consumed.
            pipelined=True,
            bytes_in_flight=(params.stages - 1) * 2 * params.block_n * d * p.element_bytes,
        )


FAMILY = DecodeF16()
