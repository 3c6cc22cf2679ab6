"""``mma_tf32`` (``kernels/mma_tf32.cu``): FlashAttention-2 forward on tensor cores, float32.

mma_f16's structure for float32 Q/K/V: a block of ``warps`` warps owns
``block_m`` query rows (16 or 32 a warp), K and V tiles of ``block_n`` keys
stream through a ``stages``-deep ``cp.async`` ring, S = Q K^T and O += P V are
``mma.sync.m16n8k8`` TF32 products with fp32 accumulators, the online softmax
runs in fp32 on exp2, and split-KV partials are merged through their
log2-sum-exps by ``mma_tf32_split_merge``.

``passes`` is the precision: 3 is the 3xTF32 split (each operand as a
hi + lo pair of TF32 values, three products per mma; the tensor cores' fp32
adds truncate, so S's small products get their own accumulator and each
tile's P V is folded into O by a rounding FFMA: errors of torch's float32 SDPA's
order on the H200, ``bench/results/tf32_2026-12-03``), 1 a single TF32 product
(10-bit significands; 2.3-2.6x faster there). The problem's precision decides
which may run: ``tf32x3`` (the float32 default) admits only 3, ``tf32`` both.

The shared-memory formula here and the kernel's layout are one contract (see
the head of ``kernels/mma_tf32.cu``): rows of ``head_dim + 4`` floats, Q's
block and ``stages`` (K, V) tile pairs.
"""

from __future__ import annotations

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

F32_BYTES = 4
#: shared rows carry 4 extra floats (16 bytes): the eight rows an ldmatrix phase
#: reads start in eight distinct 16-byte bank groups, and the scalar V loads
#: (rows 2t and 2t + 1, columns g) fall in 32 distinct banks.
SHARED_ROW_PAD = 4
#: mma.sync m16n8k8 TF32: rows of an m tile, the k step (and n8 width)
MMA_M, MMA_K = 16, 8
#: block_n steps: two n8 tiles per K ldmatrix.x4
BLOCK_N_STEP = 16
#: the largest head_dim whose accumulators fit one thread's registers
MAX_HEAD_DIM = 256
#: accumulator floats a thread may hold (O's and S's): above it ptxas spills
#: (ptxas -v on sm_90: head_dim 256 x block_n 32 x 16 rows a warp, 144 floats,
#: takes 248 registers without spills; 32 rows a warp at 64 x 64, 128 floats,
#: spills). The compiler's report is the final word; this screens the rest.
MAX_ACCUMULATORS = 144
#: products per mma for each number of passes (hi*hi; or lo*hi + hi*lo + hi*hi)
PASSES = (3, 1)
#: the CUDA grid's y and z limits (splits, batch x heads)
GRID_YZ_LIMIT = 65535
#: non-matmul work per (query, key) pair: the scaled subtract (FFMA), max, sum and exp2
NON_MATMUL_FLOPS_PER_PAIR = 4
#: integer and float instructions that split one operand value into TF32 parts:
#: round (add + mask) for hi; with three passes also the subtract and lo's round
SPLIT_OPS = {3: 5, 1: 2}
#: registers a thread takes besides its O and S accumulators, per number of passes (the
#: split operands' hi and lo parts and S's second accumulator): ptxas on sm_90, head_dim
#: 128, 20 variants of 1x1x4096x128: 142..255, the estimate within about 20 of each
REGISTER_BASE = {1: 65, 3: 150}
#: tiles per split; the largest values mean "no split" for any sequence up to 2**20 keys.
DEFAULT_SPLIT_TARGETS: tuple[int, ...] = tuple(2**k for k in range(0, 17))


def mma_tf32_shared_bytes(block_m: int, block_n: int, stages: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/mma_tf32.cu``: Q's block and the K/V ring."""
    return F32_BYTES * (head_dim + SHARED_ROW_PAD) * (block_m + 2 * stages * block_n)


def passes_allowed(problem: Problem) -> tuple[int, ...]:
    """The passes a problem's precision admits: 3 always, 1 only under ``tf32``."""
    return (3, 1) if problem.fast_tf32 else (3,)


class MmaTf32(KernelFamily):
    name = "mma_tf32"
    source = "mma_tf32.cu"
    entry_functions = ("mma_tf32_attention", "mma_tf32_split_merge")
    dtypes = ("float32",)
    tunables = (
        Tunable("block_m", 64, (32, 64, 128)),
        Tunable("block_n", 64, (32, 64)),
        Tunable("warps", 4, (2, 4, 8)),
        Tunable("stages", 2, (2, 3)),
        Tunable("passes", 3, PASSES),
        Tunable("split_target", 1 << 16, DEFAULT_SPLIT_TARGETS),
    )
    enumeration_order = ("passes", "block_m", "block_n", "warps", "stages", "split_target")
    heatmap_axes = ("block_n", "block_m")

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d, bh = problem.seq_len, problem.head_dim, problem.batch_heads
        block_m, block_n, warps = params.block_m, params.block_n, params.warps
        stages, target, passes = params.stages, params.split_target, params.passes
        if min(block_m, block_n, warps, stages, target, passes) <= 0:
            raise PlanError(
                f"block_m={block_m}, block_n={block_n}, warps={warps}, stages={stages}, "
                f"passes={passes}, split_target={target}: each must be > 0"
            )
        threads = warps * device.warp_size
        kv_len = problem.kv_len
        tile_count = span_tiles(problem, block_n)
        splits = sequence_parallel_splits(tile_count, target=target)
        tiles_per_split = div_ceil(tile_count, splits)
        keys_per_split = checked_u32(block_n * tiles_per_split, "split key span")
        shared = mma_tf32_shared_bytes(block_m, block_n, stages, d)
        rows_per_warp = block_m // warps if block_m % warps == 0 else 0
        m_tiles = rows_per_warp // MMA_M
        accumulators = m_tiles * (d + block_n) // 2
        row_blocks = div_ceil(n, block_m)

        reason = ""
        if problem.dtype not in self.dtypes:
            reason = f"dtype {problem.dtype} is not one of {', '.join(self.dtypes)}"
        elif passes not in PASSES:
            reason = f"passes={passes} is not one of {', '.join(map(str, PASSES))}"
        elif passes not in passes_allowed(problem):
            reason = (
                f"passes={passes} (one TF32 product) is less precise than precision="
                f"{problem.precision} allows"
            )
        elif d % MMA_K or d > MAX_HEAD_DIM:
            reason = f"head_dim={d} is not a multiple of {MMA_K} up to {MAX_HEAD_DIM}"
        elif rows_per_warp not in (MMA_M, 2 * MMA_M):
            reason = f"block_m={block_m} over {warps} warps is not 16 or 32 rows a warp"
        elif block_n % BLOCK_N_STEP:
            reason = f"block_n={block_n} is not a multiple of {BLOCK_N_STEP}"
        elif stages < 2:
            reason = f"stages={stages}: the cp.async ring needs at least 2"
        elif accumulators > MAX_ACCUMULATORS:
            reason = (
                f"{accumulators} accumulator floats a thread ({rows_per_warp} rows a warp, "
                f"head_dim {d} + block_n {block_n}) exceed {MAX_ACCUMULATORS}: registers spill"
            )
        if not reason:
            reason = self.variant_verdict(problem) or launch_verdict(threads, shared, device)
        if not reason and larger_than_needed(block_m, n, 32):
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
        # Each block loads its own query head's KV head: a group's query heads read the
        # same K/V rows once each (counted as requests; L2 serves the repeats).
        key_rows = visible_keys_read_per_head(problem, block_m, block_n)
        read = F32_BYTES * bh * (n * d + 2 * key_rows * d)
        write = F32_BYTES * bh * n * d
        if splits > 1:
            read += F32_BYTES * partial
            write += F32_BYTES * partial
        non_matmul = bh * (
            problem.attended_pairs * NON_MATMUL_FLOPS_PER_PAIR
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
            "PASSES": params.passes,
            **variant_defines(p),
        }

    def key(self, plan: KernelPlan) -> str:
        params = plan.params
        return (
            f"mma_tf32/x{params.passes}/m{params.block_m}/n{params.block_n}/w{params.warps}"
            f"/st{params.stages}/s{plan.sequence_splits}"
        )

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        return split_kv_launches(plan, buffers, "mma_tf32_attention", "mma_tf32_split_merge")

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """Per K/V tile and warp: ldmatrix reads of Q's rows and of the K tile, scalar
        loads of the V tile (once per m16 tile), the TF32 splits of every operand
        value a warp loads (Q, K, P and V: each warp splits the whole K and V tile),
        and per block the cp.async stores of K and V. ``ilp``: the independent m16n8
        accumulators a warp keeps in flight (S's and O's of an m tile).
        """
        p, params = plan.problem, plan.params
        d, bh, n = p.head_dim, p.batch_heads, p.seq_len
        block_n, warps, passes = params.block_n, params.warps, params.passes
        m_tiles = params.block_m // warps // MMA_M
        ldmatrix_floats = m_tiles * MMA_M * d + block_n * d
        v_floats = m_tiles * block_n * d
        per_block = (ldmatrix_floats + v_floats) * warps + 2 * block_n * d
        # ldmatrix.x4 moves 512 bytes a warp instruction, a scalar load 128, cp.async 16 a lane.
        per_warp_ops = ldmatrix_floats * F32_BYTES // 512 * 32 + v_floats * F32_BYTES // 128 * 32
        split_values = ldmatrix_floats + v_floats + m_tiles * MMA_M * block_n
        split_ops = split_values * SPLIT_OPS[passes]
        per_block_ops = (per_warp_ops + split_ops) * warps + 2 * block_n * d * F32_BYTES // 16
        executed = executed_pairs(plan, params.block_m)
        block_tiles = executed // (params.block_m * block_n)
        return CostTerms(
            matmul_pipe="mma_sync_tf32",
            executed_pairs=executed,
            exps=bh * (executed + variant_sfu_ops(p, executed)) + bh * n * plan.tile_count,
            shared_bytes=F32_BYTES * per_block * block_tiles * bh,
            shared_lane_ops=per_block_ops * block_tiles * bh,
            ilp=m_tiles * (block_n // 8 + d // 8),
            matmul_passes=passes,
            # The ring prefetches stages - 1 (K, V) tile pairs while one is consumed.
            pipelined=True,
            bytes_in_flight=(params.stages - 1) * 2 * block_n * d * F32_BYTES,
            registers=min(m_tiles * (d + block_n) // 2 + REGISTER_BASE[passes], 255),
        )


FAMILY = MmaTf32()
