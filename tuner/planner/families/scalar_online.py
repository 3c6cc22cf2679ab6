"""``scalar_online`` (``kernels/scalar_online.cu``): the seed's ScalarOnline family.

One query row per thread, ``threads`` rows per block, the row's scaled query in
registers and its output accumulator in shared memory (``[head_dim][threads]``,
the seed's ``o_acc`` scratch), every key streamed, no splits. float32 only.
The baseline, and the GPU parity reference for large float32 problems.
"""

from __future__ import annotations

import numpy as np

from tuner.device import DeviceProfile
from tuner.planner.families.base import (
    CostTerms,
    KernelFamily,
    Tunable,
    executed_pairs,
    key_rows_read_per_head,
    larger_than_needed,
    launch_verdict,
)
from tuner.planner.launches import DeviceBuffers, KernelLaunch, kernel_launch, pointers, scale_log2
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.problem import Problem

F32_BYTES = 4
#: the smallest block the space offers: never "larger than needed" for tiny sequences
SMALLEST_SCALAR_THREADS = 64
#: exp2 per attended pair: the probability and the running correction
EXPS_PER_PAIR = 2
#: the score is one dependent FMA chain per key, the accumulator update
#: independent per column (unrolled by 8): taken as 4.
SCALAR_ILP = 4


def scalar_shared_bytes(threads: int, head_dim: int) -> int:
    """Dynamic shared memory of ``kernels/scalar_online.cu``: the o accumulators."""
    return threads * head_dim * F32_BYTES


class ScalarOnline(KernelFamily):
    takes_variants = False  # a SIMT family: the variants run on the tensor-core ones
    name = "scalar_online"
    source = "scalar_online.cu"
    entry_functions = ("scalar_online_attention",)
    dtypes = ("float32",)
    tunables = (
        Tunable("threads", 128, (64, 128, 256), axis="scalar_threads", sampler="scalar_threads"),
    )
    # Rows written before tunables were per family carry the tiled family's too.
    retired_tunables = frozenset({"tile_size", "rows_per_block", "split_target"})

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d, bh = problem.seq_len, problem.head_dim, problem.batch_heads
        threads = params.threads
        shared = scalar_shared_bytes(threads, d)
        reason = self.variant_verdict(problem) or launch_verdict(threads, shared, device)
        if not reason and larger_than_needed(threads, n, SMALLEST_SCALAR_THREADS):
            reason = f"threads={threads} exceeds what seq_len={n} needs (half the block covers it)"
        row_blocks = -(-n // max(threads, 1))
        launch = Launch(grid=(row_blocks, 1, bh), block=(threads, 1, 1), shared_bytes=shared)
        pairs = problem.attended_pairs
        # Every block streams the keys its rows attend (all of them, or up to its
        # last row when causal) once; the warp-uniform key address is a broadcast.
        # Each query head's blocks read its KV head: a group's heads share K/V only in L2.
        key_rows_read = key_rows_read_per_head(n, threads, problem.causal, problem.kv_len)
        element = problem.element_bytes
        read = element * bh * (n * d + 2 * key_rows_read * d)
        write = element * bh * n * d
        blocks_per_sm = blocks_per_sm_of(threads, shared, None, device)
        occupancy, waves = occupancy_and_waves(launch, threads, blocks_per_sm, device)
        return KernelPlan(
            problem=problem,
            params=params,
            tile_size=1,
            tile_count=problem.kv_len,
            sequence_splits=1,
            tiles_per_sequence_split=problem.kv_len,
            keys_per_sequence_split=problem.kv_len,
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

    def compile_defines(self, plan: KernelPlan) -> dict[str, int]:
        p = plan.problem
        return {"HEAD_DIM": p.head_dim, "THREADS": plan.threads, "CAUSAL": int(p.causal)}

    def key(self, plan: KernelPlan) -> str:
        return f"scalar_online/t{plan.threads}"

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        q, k, v, out, _, _ = pointers(buffers)
        p = plan.problem
        seq_len, kv_len, group = np.int32(p.seq_len), np.int32(p.kv_len), np.int32(p.group)
        scale = np.float32(scale_log2(p.head_dim))
        return (
            kernel_launch(
                plan.launch,
                "scalar_online_attention",
                (q, k, v, out, seq_len, kv_len, group, scale),
            ),
        )

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        d, bh = plan.problem.head_dim, plan.problem.batch_heads
        executed = executed_pairs(plan, plan.threads)
        # Per attended key a thread loads K (float4s) and V, and reads and
        # writes each of its head_dim accumulators in shared memory.
        return CostTerms(
            matmul_pipe="ffma",
            executed_pairs=executed,
            exps=bh * executed * EXPS_PER_PAIR,
            shared_bytes=2 * F32_BYTES * d * executed * bh,
            shared_lane_ops=(d // 4 + d + 2 * d) * executed * bh,
            ilp=SCALAR_ILP,
        )


FAMILY = ScalarOnline()
