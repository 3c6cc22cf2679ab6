"""``wgmma_f16_bwd`` (``kernels/wgmma_f16_bwd.cu``): the backward on Hopper's ``wgmma``, bf16/fp16.

FlashAttention-2's backward loop (as ``mma_f16_bwd``) with every product on ``wgmma.mma_async``:
two warpgroups own a tile of 128 keys of one KV head (64 each: the M of m64nNk16, whose dK and
dV rows stay in the warpgroup's registers) and loop over the query blocks of ``block_m`` rows
that see them (``tuner.planner.backward_span``), for each query head of their share of the
group (``group_split`` shares, each writing float32 dK/dV partials that a postprocess sums, when
> 1). The transposed scores S^T = K Q^T and dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q
(P^T and dS^T from registers), then dQ = dS K from shared memory (dS stored transposed by
``stmatrix``); Q, dO and the rows' LSE and D of the next query block arrive by ``cp.async`` in
the 128-byte swizzle while this one's products run. dQ goes through shared memory to the TMA
unit's bulk float32 reductions (FlashAttention-3's dQ path), with ``deterministic=1`` in
key-tile order (``mma_f16_bwd``'s contract).

Feasibility (one-line reasons): sm_90 only (wgmma: sm_90a); head_dim 64 or 128, 64 query
rows a step (``block_m``: fixed, the key of the backward buffers' padding); shared memory
within the opt-in limit; ``group_split`` dividing the group.
"""

from __future__ import annotations

import math

import numpy as np

from tuner.device import DeviceProfile
from tuner.planner.backward_span import key_tiles, visited_blocks_per_kv_head
from tuner.planner.errors import PlanError
from tuner.planner.families.backward_base import (
    F32_BYTES,
    POSTPROCESS_THREADS,
    BackwardFamily,
    padded_rows,
)
from tuner.planner.families.base import (
    CostTerms,
    Tunable,
    launch_verdict,
    variant_defines,
    variant_sfu_ops,
)
from tuner.planner.fixed_width import U32_MAX, div_ceil
from tuner.planner.launches import BackwardBuffers, KernelLaunch
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.problem import MATMULS_PER_PAIR, Problem

ELEMENT_BYTES = 2
#: keys a block owns: two warpgroups of wgmma's 64 rows
BLOCK_N = 128
WARPGROUPS = 2
THREADS = 128 * WARPGROUPS
#: the kernel's head dims; a block takes 64 query rows a step (128 would hold S^T and dP^T of
#: 128 columns: ptxas spills them at head_dim 64, and they do not fit at 128)
HEAD_DIMS = (64, 128)
BLOCK_M = 64
GRID_YZ_LIMIT = 65535
#: ptxas, nvcc 13.0, sm_90a: 255 registers a thread for both shapes, no spills
REGISTERS = 255
#: the kernel rounds its dynamic shared base up to 1024 bytes: it asks for that much more
ALIGNMENT_SLACK = 1024
#: as mma_f16_bwd: the logit FFMA, exp2, D subtraction, the product with P, two packs, the mask
NON_MATMUL_FLOPS_PER_PAIR = 8
#: the deterministic order's wait, fence and barrier per step and thread, in issue slots
DETERMINISTIC_OPS_PER_THREAD = 8


def wgmma_f16_bwd_shared_bytes(block_m: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/wgmma_f16_bwd.cu`` (its SMEM_BYTES): K and V tiles,
    two stages of Q and dO, dS, two stages of the rows' float32 LSE and D, each warpgroup's dQ
    staging (64 rows of its head_dim / 2 columns, float32), the slack."""
    tiles = 2 * BLOCK_N * head_dim + 4 * block_m * head_dim + block_m * BLOCK_N
    staging = WARPGROUPS * 64 * (head_dim // 2)
    return ELEMENT_BYTES * tiles + F32_BYTES * (4 * block_m + staging) + ALIGNMENT_SLACK


def tiled_accumulator_elements(problem: Problem) -> int:
    """Floats of the tiled dQ accumulator: a block of 64 rows x head_dim per (batch-head,
    query block), padding rows included (``backward.cuh``'s ``backward_dq_tiled``)."""
    return problem.batch_heads * padded_rows(problem.seq_len, BLOCK_M) * problem.head_dim


class WgmmaF16Backward(BackwardFamily):
    name = "wgmma_f16_bwd"
    source = "wgmma_f16_bwd.cu"
    arch = "sm_90a"
    entry_functions = (
        "wgmma_f16_bwd_attention",
        "wgmma_f16_bwd_preprocess",
        "wgmma_f16_bwd_dq",
        "wgmma_f16_bwd_dkv",
        "wgmma_f16_bwd_sinks",
    )
    preprocess_function = "wgmma_f16_bwd_preprocess"
    dq_function = "wgmma_f16_bwd_dq"
    dkv_function = "wgmma_f16_bwd_dkv"
    sinks_function = "wgmma_f16_bwd_sinks"
    dtypes = ("bfloat16", "float16")
    tunables = (
        Tunable("block_m", BLOCK_M, (BLOCK_M,)),
        Tunable("deterministic", 0, (0, 1)),
        Tunable("group_split", 1, (1, 2, 4, 8)),
    )
    heatmap_axes = ("deterministic", "group_split")

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d = problem.seq_len, problem.head_dim
        bh, bkv = problem.batch_heads, problem.batch_kv_heads
        block_m, split = params.block_m, params.group_split
        if min(block_m, split) <= 0:
            raise PlanError(f"block_m={block_m}, group_split={split}: each must be > 0")
        tiles = key_tiles(problem, BLOCK_N)
        shared = wgmma_f16_bwd_shared_bytes(block_m, d)

        reason = self.direction_verdict(problem)
        if reason:
            pass
        elif problem.dtype not in self.dtypes:
            reason = f"dtype {problem.dtype} is not one of {', '.join(self.dtypes)}"
        elif device.compute_capability != (9, 0):
            reason = f"wgmma needs sm_90a; the device is {device.arch}"
        elif d not in HEAD_DIMS:
            reason = f"head_dim={d} is not one of {HEAD_DIMS}"
        elif block_m != BLOCK_M:
            reason = f"block_m={block_m}: the kernel takes {BLOCK_M} query rows a step"
        elif params.deterministic not in (0, 1):
            reason = f"deterministic={params.deterministic} is not 0 (atomic dQ) or 1"
        elif problem.group % split:
            reason = (
                f"group_split={split} does not divide the {problem.group} query heads of a group"
            )
        if not reason:
            reason = self.variant_verdict(problem) or launch_verdict(THREADS, shared, device)
        if not reason and (split > GRID_YZ_LIMIT or bkv > GRID_YZ_LIMIT):
            reason = f"{split} group shares x {bkv} batch-KV-heads exceed the grid's y/z limit"
        partial = 2 * bkv * split * problem.kv_len * d if split > 1 else 0
        if not reason and max(partial, bh * padded_rows(n, block_m) * d) > U32_MAX:
            reason = f"scratch of {max(partial, bh * n * d)} floats overflows u32"

        launch = Launch(grid=(tiles, split, bkv), block=(THREADS, 1, 1), shared_bytes=shared)
        read, write = self.traffic(
            problem, block_m, BLOCK_N, split, tiled_accumulator_elements(problem)
        )
        steps = visited_blocks_per_kv_head(problem, block_m, BLOCK_N)
        non_matmul = bh * (steps * block_m * BLOCK_N * NON_MATMUL_FLOPS_PER_PAIR + 2 * n * d)
        if params.deterministic:
            non_matmul += bh * steps * THREADS * DETERMINISTIC_OPS_PER_THREAD
        blocks_per_sm = blocks_per_sm_of(THREADS, shared, REGISTERS, device)
        occupancy, waves = occupancy_and_waves(launch, THREADS, blocks_per_sm, device)
        if not reason and blocks_per_sm == 0:
            reason = f"{THREADS} threads with {shared} B shared memory do not fit on one SM"
        return KernelPlan(
            problem=problem,
            params=params,
            tile_size=BLOCK_N,
            tile_count=tiles,
            sequence_splits=1,
            tiles_per_sequence_split=tiles,
            keys_per_sequence_split=tiles * BLOCK_N,
            split_reduce_scratch_elements=0,
            parallel_workgroups_per_row=tiles,  # every key tile adds to each row's dQ
            rows_per_block=block_m,
            threads_per_row=4,
            rows_per_thread=2,
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
            "DETERMINISTIC": params.deterministic,
            "CAUSAL": int(p.causal),
            "IS_FP16": int(p.dtype == "float16"),
            **variant_defines(p),
        }

    def key(self, plan: KernelPlan) -> str:
        params = plan.params
        mode = "det" if params.deterministic else "atomic"
        return f"wgmma_f16_bwd/m{params.block_m}/{mode}/g{params.group_split}"

    def dq_accumulator_elements(self, plan: KernelPlan) -> int:
        return tiled_accumulator_elements(plan.problem)

    def dq_launch(self, plan: KernelPlan, buffers: BackwardBuffers) -> KernelLaunch:
        """``wgmma_f16_bwd_dq(dq_accum, dq, seq_len, batch_heads, scale)``: a thread per 4
        values of the tiled accumulator."""
        p = plan.problem
        quads = self.dq_accumulator_elements(plan) // 4
        return KernelLaunch(
            self.dq_function,
            (div_ceil(quads, POSTPROCESS_THREADS), 1, 1),
            (POSTPROCESS_THREADS, 1, 1),
            0,
            (
                np.uintp(buffers.dq_accum),
                np.uintp(buffers.dq),
                np.int32(p.seq_len),
                np.int32(p.batch_heads),
                np.float32(1 / math.sqrt(p.head_dim)),
            ),
        )

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        """Per step (the key tile against a query block): the wgmma products read the K and V
        tiles, Q and dO (twice each: S^T/dP^T, then dK/dV) and dS with K (dQ) from shared
        memory through descriptors; the threads store dS and the cp.async copies of Q and dO.
        ``ilp``: each warpgroup's asynchronous chains (S^T, dP^T, then dK, dV, dQ)."""
        p, params = plan.problem, plan.params
        d, bh = p.head_dim, p.batch_heads
        block_m = params.block_m
        steps = visited_blocks_per_kv_head(p, block_m, BLOCK_N)
        executed = steps * block_m * BLOCK_N
        reads = 2 * BLOCK_N * d + 4 * WARPGROUPS * block_m * d + 2 * block_m * BLOCK_N + BLOCK_N * d
        writes = block_m * BLOCK_N + 2 * block_m * d
        per_step = ELEMENT_BYTES * (reads + writes)
        return CostTerms(
            matmul_pipe="wgmma_f16",
            executed_pairs=executed,
            exps=bh * (executed + variant_sfu_ops(p, executed)),
            shared_bytes=per_step * steps * bh,
            # stmatrix of dS and the cp.async copies: 16 bytes a lane instruction
            shared_lane_ops=ELEMENT_BYTES * writes * steps * bh // 16,
            ilp=WARPGROUPS * (block_m // 8 + d // 8),
            pipelined=True,
            bytes_in_flight=block_m * (2 * d * p.element_bytes + 2 * F32_BYTES),
            registers=REGISTERS,
            matmuls_per_pair=MATMULS_PER_PAIR["backward"],
        )


FAMILY = WgmmaF16Backward()
