"""``mma_f16_bwd`` (``kernels/mma_f16_bwd.cu``): FlashAttention-2's backward on mma.sync, bf16/fp16.

A block of ``warps`` warps owns ``block_n`` keys of one KV head (16 or 32 a warp, whose dK and
dV rows stay in the warp's registers) and loops over the query blocks of ``block_m`` rows that
see them (``tuner.planner.backward_span``), for each query head of its share of the group
(``group_split`` shares, each writing float32 dK/dV partials that a postprocess sums, when
> 1). Q, dO and the rows' LSE and D arrive by ``cp.async`` (``stages=2``: the next block's
under this one's math; 1: under the dQ phase); the warps work through a block ``q_chunk``
queries at a time; dQ goes through shared memory to float32 atomics, or with
``deterministic=1`` to additions ordered by key tile.

Feasibility: head_dim a multiple of 16 up to 128 (a warp's dK and dV accumulators are
``keys_per_warp * head_dim / 16`` registers a thread: 128 at 16 keys x 128), the registers
estimate (``mma_f16_bwd_registers``) at most 255 (ptxas then decides: spills are infeasible),
shared memory (``mma_f16_bwd_shared_bytes``, the kernel's layout) within the opt-in limit,
``group_split`` dividing the group.
"""

from __future__ import annotations

from tuner.device import DeviceProfile
from tuner.planner.backward_span import key_tiles, visited_blocks_per_kv_head
from tuner.planner.errors import PlanError
from tuner.planner.families.backward_base import (
    F32_BYTES,
    BackwardFamily,
    padded_rows,
)
from tuner.planner.families.base import (
    CostTerms,
    Tunable,
    larger_than_needed,
    launch_verdict,
    variant_defines,
    variant_sfu_ops,
)
from tuner.planner.fixed_width import U32_MAX
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.problem import MATMULS_PER_PAIR, Problem

ELEMENT_BYTES = 2
#: shared rows carry 8 extra elements (16 bytes): conflict-free ldmatrix (as mma_f16)
SHARED_ROW_PAD = 8
MMA_M = MMA_K = 16
#: the largest head_dim whose dK and dV accumulators fit a thread's registers
MAX_HEAD_DIM = 128
GRID_YZ_LIMIT = 65535
#: registers besides the dK/dV accumulators and the chunk's scores (ptxas, sm_90)
REGISTER_BASE = 84
#: per computed pair besides the products: the logit FFMA, exp2, D subtraction, the
#: product with P, the two packs to 16 bits and the mask's select
NON_MATMUL_FLOPS_PER_PAIR = 8
#: what the deterministic dQ order adds per step and thread (the wait, a fence, a barrier),
#: in issue slots: small, but it ranks an atomic plan before its deterministic twin
DETERMINISTIC_OPS_PER_THREAD = 8


def mma_f16_bwd_shared_bytes(block_m: int, block_n: int, stages: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/mma_f16_bwd.cu``: K and V tiles, dS^T, and per stage
    Q and dO tiles and the rows' float32 LSE and D."""
    row = head_dim + SHARED_ROW_PAD
    elements = 2 * block_n * row + block_n * (block_m + SHARED_ROW_PAD) + stages * 2 * block_m * row
    return ELEMENT_BYTES * elements + F32_BYTES * stages * 2 * block_m


def mma_f16_bwd_registers(keys_per_warp: int, head_dim: int, q_chunk: int) -> int:
    """Registers a thread takes, as ptxas reports them (an estimate for occupancy and for
    ruling out what cannot fit). Per m16 tile of keys a thread holds head_dim / 4 fp32 dK and
    as many dV accumulators (head_dim / 2) and q_chunk / 2 scores and dP values (q_chunk /
    2); about 84 more. nvcc 13.0, sm_90: 237 (head_dim 128, 16 keys a warp, chunk 16; this
    says 228), 245 (chunk 32: 260 -> over), 238 (64, 32 keys: 244), 148 (64, 16 keys: 164)."""
    tiles = keys_per_warp // MMA_M
    return REGISTER_BASE + tiles * (head_dim + q_chunk)


def dq_tiles(head_dim: int, block_m: int, warps: int) -> int:
    """n8 tiles of head_dim in one warp's dQ unit (the kernel's ``dq_tiles()``): the largest
    even divisor of head_dim / 8 up to 8 that still gives every warp a unit, else 2."""
    d_tiles, m_tiles = head_dim // 8, block_m // MMA_M
    best = 2
    for tiles in range(4, min(8, d_tiles) + 1, 2):
        if d_tiles % tiles == 0 and m_tiles * (d_tiles // tiles) >= warps:
            best = tiles
    return best


class MmaF16Backward(BackwardFamily):
    name = "mma_f16_bwd"
    source = "mma_f16_bwd.cu"
    entry_functions = (
        "mma_f16_bwd_attention",
        "mma_f16_bwd_preprocess",
        "mma_f16_bwd_dq",
        "mma_f16_bwd_dkv",
        "mma_f16_bwd_sinks",
    )
    preprocess_function = "mma_f16_bwd_preprocess"
    dq_function = "mma_f16_bwd_dq"
    dkv_function = "mma_f16_bwd_dkv"
    sinks_function = "mma_f16_bwd_sinks"
    dtypes = ("bfloat16", "float16")
    tunables = (
        Tunable("block_m", 64, (32, 64, 128)),
        Tunable("block_n", 128, (64, 128, 256)),
        Tunable("warps", 8, (4, 8)),
        Tunable("stages", 2, (1, 2)),
        Tunable("q_chunk", 16, (16, 32)),
        Tunable("deterministic", 0, (0, 1)),
        Tunable("group_split", 1, (1, 2, 4, 8)),
    )
    heatmap_axes = ("block_n", "block_m")

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d = problem.seq_len, problem.head_dim
        bh, bkv = problem.batch_heads, problem.batch_kv_heads
        block_m, block_n, warps = params.block_m, params.block_n, params.warps
        stages, q_chunk, split = params.stages, params.q_chunk, params.group_split
        if min(block_m, block_n, warps, stages, q_chunk, split) <= 0:
            raise PlanError(
                f"block_m={block_m}, block_n={block_n}, warps={warps}, stages={stages}, "
                f"q_chunk={q_chunk}, group_split={split}: each must be > 0"
            )
        threads = warps * device.warp_size
        keys_per_warp = block_n // warps if block_n % warps == 0 else 0
        tiles = key_tiles(problem, block_n)
        shared = mma_f16_bwd_shared_bytes(block_m, block_n, stages, d)
        registers = mma_f16_bwd_registers(keys_per_warp, d, q_chunk)

        reason = self.direction_verdict(problem)
        if reason:
            pass
        elif problem.dtype not in self.dtypes:
            reason = f"dtype {problem.dtype} is not one of {', '.join(self.dtypes)}"
        elif d % MMA_K or d > MAX_HEAD_DIM:
            reason = (
                f"head_dim={d} is not a multiple of {MMA_K} up to {MAX_HEAD_DIM} (a warp's dK "
                "and dV accumulators must fit its registers)"
            )
        elif keys_per_warp not in (MMA_M, 2 * MMA_M):
            reason = f"block_n={block_n} over {warps} warps is not 16 or 32 keys a warp"
        elif q_chunk not in (16, 32) or block_m % q_chunk:
            reason = f"q_chunk={q_chunk} is not 16 or 32 dividing block_m={block_m}"
        elif stages not in (1, 2):
            reason = f"stages={stages}: the query tiles are single (1) or double (2) buffered"
        elif params.deterministic not in (0, 1):
            reason = f"deterministic={params.deterministic} is not 0 (atomic dQ) or 1"
        elif problem.group % split:
            reason = (
                f"group_split={split} does not divide the {problem.group} query heads of a group"
            )
        if not reason:
            reason = self.variant_verdict(problem) or launch_verdict(threads, shared, device)
        if not reason and registers > device.max_registers_per_thread:
            reason = (
                f"about {registers} registers a thread ({keys_per_warp} keys a warp x head_dim "
                f"{d} of dK and dV, chunk {q_chunk}) exceed {device.max_registers_per_thread}"
            )
        if not reason and larger_than_needed(block_m, n, 32):
            reason = f"block_m={block_m} is larger than needed for seq_len={n}"
        if not reason and larger_than_needed(block_n, problem.kv_len, 64):
            reason = f"block_n={block_n} is larger than needed for kv_len={problem.kv_len}"
        if not reason and (split > GRID_YZ_LIMIT or bkv > GRID_YZ_LIMIT):
            reason = f"{split} group shares x {bkv} batch-KV-heads exceed the grid's y/z limit"
        partial = 2 * bkv * split * problem.kv_len * d if split > 1 else 0
        if not reason and max(partial, bh * padded_rows(n, block_m) * d) > U32_MAX:
            reason = f"scratch of {max(partial, bh * n * d)} floats overflows u32"

        launch = Launch(grid=(tiles, split, bkv), block=(threads, 1, 1), shared_bytes=shared)
        read, write = self.traffic(problem, block_m, block_n, split, bh * n * d)
        steps = visited_blocks_per_kv_head(problem, block_m, block_n)
        non_matmul = bh * (steps * block_m * block_n * NON_MATMUL_FLOPS_PER_PAIR + 2 * n * d)
        if params.deterministic:
            # per step: the turn's wait, a fence and a barrier more for every thread
            non_matmul += bh * steps * threads * DETERMINISTIC_OPS_PER_THREAD
        blocks_per_sm = blocks_per_sm_of(threads, shared, None, device)
        occupancy, waves = occupancy_and_waves(launch, threads, blocks_per_sm, device)
        if not reason and blocks_per_sm == 0:
            reason = f"{threads} threads with {shared} B shared memory do not fit on one SM"
        return KernelPlan(
            problem=problem,
            params=params,
            tile_size=block_n,
            tile_count=tiles,
            sequence_splits=1,
            tiles_per_sequence_split=tiles,
            keys_per_sequence_split=tiles * block_n,
            split_reduce_scratch_elements=0,
            parallel_workgroups_per_row=tiles,  # every key tile adds to each row's dQ
            rows_per_block=block_m,
            threads_per_row=4,
            rows_per_thread=max(keys_per_warp // 8, 1),
            launch=launch,
            reduce_launch=None,
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
            "Q_CHUNK": params.q_chunk,
            "DETERMINISTIC": params.deterministic,
            "CAUSAL": int(p.causal),
            "IS_FP16": int(p.dtype == "float16"),
            **variant_defines(p),
        }

    def key(self, plan: KernelPlan) -> str:
        params = plan.params
        mode = "det" if params.deterministic else "atomic"
        return (
            f"mma_f16_bwd/m{params.block_m}/n{params.block_n}/w{params.warps}/st{params.stages}"
            f"/c{params.q_chunk}/{mode}/g{params.group_split}"
        )

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """Per step (a key tile against a query block) and block: every warp reads the Q and
        dO tiles twice (B operands of S^T and dP^T, then transposed for dK and dV) and its K
        and V rows once per chunk; dS^T is stored, then read by the dQ units with the K tile
        once per m16 tile of queries; the cp.async stores of Q and dO. ``ilp``: the
        independent accumulators a warp keeps in flight (scores, then dK/dV chains)."""
        p, params = plan.problem, plan.params
        d, bh = p.head_dim, p.batch_heads
        block_m, block_n, warps = params.block_m, params.block_n, params.warps
        q_chunk = params.q_chunk
        keys_per_warp = block_n // warps
        steps = visited_blocks_per_kv_head(p, block_m, block_n)
        executed = steps * block_m * block_n
        per_warp = 4 * block_m * d + (block_m // q_chunk) * 2 * keys_per_warp * d
        units_per_m_tile = d // 8 // dq_tiles(d, block_m, warps)
        dq = units_per_m_tile * block_m * block_n + (block_m // MMA_M) * block_n * d
        per_step = ELEMENT_BYTES * (warps * per_warp + block_n * block_m + dq + 2 * block_m * d)
        shared = per_step * steps * bh
        k_tiles = keys_per_warp // MMA_M
        return CostTerms(
            matmul_pipe="mma_sync_f16",
            executed_pairs=executed,
            exps=bh * (executed + variant_sfu_ops(p, executed)),
            shared_bytes=shared,
            shared_lane_ops=shared // 16,
            ilp=k_tiles * (q_chunk // 4 + d // 4),
            pipelined=True,
            bytes_in_flight=block_m * (2 * d * p.element_bytes + 2 * F32_BYTES),
            registers=min(mma_f16_bwd_registers(keys_per_warp, d, q_chunk), 255),
            matmuls_per_pair=MATMULS_PER_PAIR["backward"],
        )


FAMILY = MmaF16Backward()
