"""``mma_f16`` (``kernels/mma_f16.cu``): FlashAttention-2 forward on tensor cores, bf16/fp16.

A block of ``warps`` warps owns ``block_m`` query rows of one (batch, head),
16 or 32 rows a warp (one or two m16 tiles). K and V tiles of ``block_n`` keys
stream through a ``stages``-deep ``cp.async`` ring in shared memory; S = Q K^T
and O += P V are ``mma.sync.m16n8k16`` products with fp32 accumulators, P stays
in registers, and the online softmax runs in fp32 on exp2 with the scale
folded in. Q's fragments are kept in registers (``q_in_registers=1``) or read
from shared memory at every k-step (``0``: fewer registers, more ldmatrix).
Long key ranges split over blocks (``split_target`` tiles a split, the seed's
rule); their float32 partial outputs and log2-sum-exps are merged by
``mma_f16_split_merge``. Causal masking is bottom-right aligned. With two
m16 tiles a warp, ``s_groups=2`` computes S one m tile at a time (K read
twice, half the score registers live): at head_dim 128 it is what keeps the
32-row warps free of spills.

The shared-memory formula here and the kernel's layout are one contract (see
the head of ``kernels/mma_f16.cu``): rows of ``head_dim + 8`` 2-byte elements,
Q's block and ``stages`` (K, V) tile pairs.
"""

from __future__ import annotations

from collections.abc import Mapping

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.families.base import (
    CostTerms,
    KernelFamily,
    Tunable,
    checked_u32,
    executed_pairs,
    float4_merge_launch,
    larger_than_needed,
    launch_verdict,
    split_kv_launches,
    splits_over_key_tiles,
    variant_defines,
    variant_sfu_ops,
)
from tuner.planner.fixed_width import U32_MAX, div_ceil
from tuner.planner.key_span import span_tiles, visible_keys_read_per_head
from tuner.planner.launches import DeviceBuffers, KernelLaunch
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.planner.seed import sequence_parallel_splits, split_reduce_scratch_elements
from tuner.problem import Problem

ELEMENT_BYTES = 2
F32_BYTES = 4
#: shared rows carry 8 extra elements (16 bytes): the eight rows one ldmatrix
#: phase reads then start in eight distinct 16-byte bank groups.
SHARED_ROW_PAD = 8
#: mma.sync m16n8k16: rows of an m tile, the k step, and the n8 width
MMA_M, MMA_K = 16, 16
#: the largest head_dim whose accumulators fit one thread's registers
MAX_HEAD_DIM = 256
#: the CUDA grid's y and z limits (splits, batch x heads)
GRID_YZ_LIMIT = 65535
#: non-matmul work per (query, key) pair: the scaled subtract (FFMA), max, sum,
#: the pack to 16 bits (half an instruction a value), and the exp2 itself
NON_MATMUL_FLOPS_PER_PAIR = 5
#: registers a thread takes besides its accumulators and Q fragments (ptxas, sm_90)
REGISTER_BASE = 70
#: tiles per split; the largest values mean "no split" for any sequence up to 2**20 keys.
DEFAULT_SPLIT_TARGETS: tuple[int, ...] = tuple(2**k for k in range(0, 17))


def mma_f16_shared_bytes(block_m: int, block_n: int, stages: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/mma_f16.cu``: Q's block and the K/V ring."""
    return ELEMENT_BYTES * (head_dim + SHARED_ROW_PAD) * (block_m + 2 * stages * block_n)


def mma_f16_registers(
    m_tiles: int, s_groups: int, block_n: int, head_dim: int, q_in_registers: bool
) -> int:
    """Registers a thread takes, as ptxas reports them (an estimate for occupancy).

    Per m16 tile a thread holds head_dim / 2 fp32 O accumulators, per S group
    block_n / 2 fp32 scores and their packed 16-bit copy (block_n / 4), and with
    Q in registers head_dim / 4 of Q's fragments; about 70 more for addresses,
    softmax state and the loop. Within 8 registers of ptxas (nvcc 13.0, sm_90,
    head_dim 128: 160..255 over 86 variants of 4x16x4096x128, bf16, full and causal).
    """
    values = m_tiles * head_dim // 2 + (m_tiles // s_groups) * block_n * 3 // 4
    if q_in_registers:
        values += m_tiles * head_dim // 4
    return min(REGISTER_BASE + values, 255)


class MmaF16(KernelFamily):
    name = "mma_f16"
    source = "mma_f16.cu"
    entry_functions = ("mma_f16_attention", "mma_f16_split_merge")
    dtypes = ("bfloat16", "float16")
    tunables = (
        Tunable("block_m", 128, (64, 128, 256)),
        Tunable("block_n", 64, (32, 48, 64, 128)),
        Tunable("warps", 4, (4, 8)),
        Tunable("stages", 2, (2, 3)),
        Tunable("q_in_registers", 0, (0, 1)),
        Tunable("s_groups", 1, (1, 2)),
        Tunable("split_target", 1 << 16, DEFAULT_SPLIT_TARGETS),
    )
    enumeration_order = (
        "block_m",
        "block_n",
        "warps",
        "stages",
        "q_in_registers",
        "s_groups",
        "split_target",
    )
    heatmap_axes = ("block_n", "block_m")

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d, bh = problem.seq_len, problem.head_dim, problem.batch_heads
        kv_len = problem.kv_len
        block_m, block_n, warps = params.block_m, params.block_n, params.warps
        stages, target = params.stages, params.split_target
        if min(block_m, block_n, warps, stages, target) <= 0:
            raise PlanError(
                f"block_m={block_m}, block_n={block_n}, warps={warps}, stages={stages}, "
                f"split_target={target}: each must be > 0"
            )
        threads = warps * device.warp_size
        tile_count = span_tiles(problem, block_n)
        splits = sequence_parallel_splits(tile_count, target=target)
        tiles_per_split = div_ceil(tile_count, splits)
        keys_per_split = checked_u32(block_n * tiles_per_split, "split key span")
        shared = mma_f16_shared_bytes(block_m, block_n, stages, d)
        rows_per_warp = block_m // warps if block_m % warps == 0 else 0
        row_blocks = div_ceil(n, block_m)

        reason = ""
        if problem.dtype not in self.dtypes:
            reason = f"dtype {problem.dtype} is not one of {', '.join(self.dtypes)}"
        elif d % MMA_K or d > MAX_HEAD_DIM:
            reason = f"head_dim={d} is not a multiple of {MMA_K} up to {MAX_HEAD_DIM}"
        elif rows_per_warp not in (MMA_M, 2 * MMA_M):
            reason = f"block_m={block_m} over {warps} warps is not 16 or 32 rows a warp"
        elif params.s_groups not in (1, 2) or (rows_per_warp // MMA_M) % params.s_groups:
            reason = (
                f"s_groups={params.s_groups} does not divide the {rows_per_warp // MMA_M} "
                "m16 tiles of a warp"
            )
        elif block_n % MMA_K:
            reason = f"block_n={block_n} is not a multiple of {MMA_K}"
        elif stages < 2:
            reason = f"stages={stages}: the cp.async ring needs at least 2"
        if not reason:
            reason = self.variant_verdict(problem) or launch_verdict(threads, shared, device)
        if not reason and larger_than_needed(block_m, n, 64):
            reason = f"block_m={block_m} is larger than needed for seq_len={n}"
        if not reason and larger_than_needed(block_n, kv_len, 32):
            reason = f"block_n={block_n} is larger than needed for kv_len={kv_len}"
        if not reason and (splits > GRID_YZ_LIMIT or bh > GRID_YZ_LIMIT):
            reason = f"{splits} splits x {bh} batch-heads exceed the grid's y/z limit"
        partial = bh * splits * n * (d + 1) if splits > 1 else 0
        if not reason and partial > U32_MAX:
            reason = f"split scratch of {partial} floats overflows u32"

        launch = Launch(grid=(row_blocks, splits, bh), block=(threads, 1, 1), shared_bytes=shared)
        reduce_launch = float4_merge_launch(bh, n, d, splits)
        element = problem.element_bytes
        # Every block loads its own query head's KV head: a group's query heads read
        # the same K/V rows once each. Counted as requests (what L2 serves); DRAM
        # sees about one read per KV head when the group's blocks run together,
        # which the launch order (heads slowest) makes likely but does not enforce.
        key_rows = visible_keys_read_per_head(problem, block_m, block_n)
        read = element * bh * (n * d + 2 * key_rows * d)
        write = element * bh * n * d
        if splits > 1:
            read += F32_BYTES * partial
            write += F32_BYTES * partial
        non_matmul = bh * (
            problem.attended_pairs * NON_MATMUL_FLOPS_PER_PAIR
            # per row and tile: the max merge, the correction's exp2, and the
            # rescale of the row's head_dim accumulators
            + n * tile_count * (d + 4)
            + n * (splits - 1) * d * 3
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
            tiles_per_sequence_split=tiles_per_split,
            keys_per_sequence_split=keys_per_split,
            split_reduce_scratch_elements=split_reduce_scratch_elements(splits, d),
            parallel_workgroups_per_row=splits,
            rows_per_block=block_m,
            threads_per_row=4,  # an mma row's scores live in a quad of lanes
            rows_per_thread=max(rows_per_warp // 8, 1),
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
            "BLOCK_M": params.block_m,
            "BLOCK_N": params.block_n,
            "WARPS": params.warps,
            "STAGES": params.stages,
            "CAUSAL": int(p.causal),
            "IS_FP16": int(p.dtype == "float16"),
            "Q_IN_REGISTERS": params.q_in_registers,
            "S_GROUPS": params.s_groups,
            **variant_defines(p),
        }

    def split_count(self, problem: Problem, values: Mapping[str, int]) -> int | None:
        return splits_over_key_tiles(problem, values)

    def key(self, plan: KernelPlan) -> str:
        params = plan.params
        return (
            f"mma_f16/m{params.block_m}/n{params.block_n}/w{params.warps}/st{params.stages}"
            f"/q{'reg' if params.q_in_registers else 'smem'}/g{params.s_groups}"
            f"/s{plan.sequence_splits}"
        )

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        return split_kv_launches(plan, buffers, "mma_f16_attention", "mma_f16_split_merge")

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """Shared traffic per K/V tile and warp: ldmatrix reads of the K tile (once
        per S group), of the V tile (once per m16 tile: softmax and P.V run one m
        tile at a time) and, with Q in shared memory, of the warp's Q rows; per
        block the cp.async stores of K and V. ``ilp``: the independent m16n8
        accumulators (S's and O's) a warp keeps in flight.
        """
        p, params = plan.problem, plan.params
        d, bh, n = p.head_dim, p.batch_heads, p.seq_len
        block_n = params.block_n
        warps = params.warps
        m_tiles = params.block_m // warps // MMA_M
        q_reads = 0 if params.q_in_registers else m_tiles * MMA_M * d
        per_warp = params.s_groups * block_n * d + m_tiles * block_n * d + q_reads
        per_block = per_warp * warps + 2 * block_n * d
        # ldmatrix.x4 moves 512 bytes a warp instruction; cp.async 16 bytes a lane.
        ldmatrix_ops = per_warp * ELEMENT_BYTES // 512 * 32
        per_block_ops = ldmatrix_ops * warps + 2 * block_n * d * ELEMENT_BYTES // 16
        executed = executed_pairs(plan, params.block_m)
        block_tiles = executed // (params.block_m * block_n)
        return CostTerms(
            matmul_pipe="mma_sync_f16",
            executed_pairs=executed,
            exps=bh * (executed + variant_sfu_ops(p, executed)) + bh * n * plan.tile_count,
            shared_bytes=ELEMENT_BYTES * per_block * block_tiles * bh,
            shared_lane_ops=per_block_ops * block_tiles * bh,
            # Independent mma chains a warp has in flight over a tile: the S
            # accumulators of one S group plus the O accumulators of an m tile.
            # Counting S's alone (as a SIMT micro-tile would) ranked the H200
            # probe grids with Spearman 0.20/0.33/0.20/0.16 (4x16x4096x128 full,
            # causal, 1x16x1000x128, 1x32x8192x128); with both, 0.55/0.71/0.74/0.31
            # (bench/costmodel_mma_f16.py on bench/results/mma_probe_2026-12-03).
            ilp=m_tiles // params.s_groups * (block_n // 8) + d // 8,
            # The ring prefetches stages - 1 (K, V) tile pairs while one is consumed.
            pipelined=True,
            bytes_in_flight=(params.stages - 1) * 2 * block_n * d * p.element_bytes,
            registers=mma_f16_registers(
                m_tiles, params.s_groups, block_n, d, bool(params.q_in_registers)
            ),
        )


FAMILY = MmaF16()
