"""What every backward family shares: its direction, its buffers and the launches around its
main kernel (``kernels/include/fa/backward.cuh``'s preprocess and postprocesses).

A backward run reads q, k, v, the forward's output and log-sum-exps and dO, and writes dq,
dk, dv (``BackwardBuffers``); its scratch is the float32 rows of the preprocess (``lse_log2``,
``delta``, padded to whole query blocks), the float32 dQ accumulator, the deterministic
mode's counters and the float32 dK/dV partials of a split group (``BackwardScratch``). The
launches: the preprocess, the family's main kernel (one entry contract: ``main_arguments``),
the dQ cast, the dK/dV sum (with split groups) and the sinks' gradient (with sinks); the
bytes they move (``traffic``). Pure: stdlib, numpy scalars, the planner.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from tuner.planner.backward_span import visited_blocks_per_kv_head
from tuner.planner.families.base import KernelFamily
from tuner.planner.fixed_width import div_ceil
from tuner.planner.launches import (
    BackwardBuffers,
    BackwardScratch,
    BufferElements,
    DeviceBuffers,
    KernelArgument,
    KernelLaunch,
    scale_log2,
)
from tuner.planner.plan import KernelPlan
from tuner.problem import Problem

F32_BYTES = 4
#: threads of the preprocess (a warp per row) and of the elementwise postprocesses
PREPROCESS_THREADS = 128
PREPROCESS_ROWS_PER_BLOCK = PREPROCESS_THREADS // 32
POSTPROCESS_THREADS = 128
#: the sinks' gradient: one warp per head
SINK_THREADS = 32


def padded_rows(seq_len: int, block_m: int) -> int:
    """Query rows padded to whole query blocks: the rows of ``lse_log2`` and ``delta``."""
    return div_ceil(seq_len, block_m) * block_m


class BackwardFamily(KernelFamily):
    """A backward family: ``plan`` and ``cost_terms`` as any family; ``block_m`` (query rows a
    step) and ``group_split`` (shares of a group's query heads) are what the shared launches
    need of its params."""

    direction: ClassVar[str] = "backward"
    #: the entry names of the shared launches, in the family's cubin
    preprocess_function: ClassVar[str]
    dq_function: ClassVar[str]
    dkv_function: ClassVar[str]
    sinks_function: ClassVar[str]

    def main_arguments(
        self, plan: KernelPlan, buffers: BackwardBuffers
    ) -> tuple[KernelArgument, ...]:
        """The main kernel's arguments, the entry contract every backward family keeps
        (``kernels/mma_f16_bwd.cu``'s ``mma_f16_bwd_attention``): q, k, v, dO, lse_log2, D,
        the dQ accumulator, dk, dv, the dK/dV partials (null without a group split), the
        counters (null outside the deterministic mode), seq_len, kv_len, group, scale_log2,
        heads, the window, the softcap and the ALiBi slopes."""
        p = plan.problem
        return (
            np.uintp(buffers.q),
            np.uintp(buffers.k),
            np.uintp(buffers.v),
            np.uintp(buffers.dout),
            np.uintp(buffers.lse_log2),
            np.uintp(buffers.delta),
            np.uintp(buffers.dq_accum),
            np.uintp(buffers.dk),
            np.uintp(buffers.dv),
            np.uintp(buffers.dkv_partial if self.group_split(plan) > 1 else 0),
            np.uintp(buffers.counters if self.deterministic(plan) else 0),
            np.int32(p.seq_len),
            np.int32(p.kv_len),
            np.int32(p.group),
            np.float32(scale_log2(p.head_dim)),
            np.int32(p.heads),
            np.int32(p.window_left),
            np.int32(p.window_right),
            np.float32(p.softcap),
            np.uintp(buffers.alibi_slopes),
        )

    @staticmethod
    def traffic(
        problem: Problem, block_m: int, block_n: int, group_split: int, accumulator_floats: int
    ) -> tuple[int, int]:
        """(read, written) bytes of the launches, as requested (L2 serves repeats): the
        preprocess reads O, dO and the LSE and writes the padded rows and the zeroed dQ
        accumulator (``accumulator_floats``: ``dq_accumulator_elements``); each main block
        reads its K/V tile once and, per step, a Q and dO tile and their rows, adding a block
        of dQ (an atomic or bulk reduction reads and writes in L2); the casts; the dK/dV
        partials of a split group."""
        p = problem
        element, d, bh = p.element_bytes, p.head_dim, p.batch_heads
        rows = bh * padded_rows(p.seq_len, block_m)
        accumulator = F32_BYTES * accumulator_floats
        steps = bh * visited_blocks_per_kv_head(p, block_m, block_n)
        read = 2 * p.tensor_bytes + F32_BYTES * bh * p.seq_len  # preprocess
        write = 2 * F32_BYTES * rows + accumulator
        read += 2 * group_split * p.kv_tensor_bytes  # main: K, V tiles
        read += steps * block_m * (2 * d * element + 2 * F32_BYTES)
        read += steps * block_m * d * F32_BYTES  # dQ additions: read and write in L2
        write += steps * block_m * d * F32_BYTES
        read += accumulator  # dQ cast
        write += p.tensor_bytes
        if group_split > 1:
            partial = 2 * F32_BYTES * p.batch_kv_heads * group_split * p.kv_len * d
            write += partial
            read += partial
        write += 2 * p.kv_tensor_bytes
        return read, write

    def block_m(self, plan: KernelPlan) -> int:
        return plan.params.block_m

    def group_split(self, plan: KernelPlan) -> int:
        return plan.params.group_split

    def deterministic(self, plan: KernelPlan) -> bool:
        return bool(plan.params.deterministic)

    def buffer_elements(self, plan: KernelPlan) -> BufferElements:
        """q, k, v, out in the problem's dtype; no split scratch (``backward_scratch``)."""
        p = plan.problem
        return BufferElements(p.batch_heads * p.seq_len * p.head_dim, 0, 0, p.element_bytes)

    def dq_accumulator_elements(self, plan: KernelPlan) -> int:
        """Floats of the dQ accumulator: one per element of dQ ([batch * heads][seq_len]
        [head_dim]); a family whose accumulator is laid out otherwise says its own."""
        p = plan.problem
        return p.batch_heads * p.seq_len * p.head_dim

    def dq_launch(self, plan: KernelPlan, buffers: BackwardBuffers) -> KernelLaunch:
        """The dQ cast: ``dq_function(dq_accum, dq, quads, scale)``, a thread per 4 values of
        the row-major accumulator (``backward.cuh``'s ``backward_dq``)."""
        p = plan.problem
        quads = p.batch_heads * p.seq_len * p.head_dim // 4
        return KernelLaunch(
            self.dq_function,
            (div_ceil(quads, POSTPROCESS_THREADS), 1, 1),
            (POSTPROCESS_THREADS, 1, 1),
            0,
            (
                np.uintp(buffers.dq_accum),
                np.uintp(buffers.dq),
                np.int32(quads),
                np.float32(1 / math.sqrt(p.head_dim)),
            ),
        )

    def backward_scratch(self, plan: KernelPlan) -> BackwardScratch:
        p = plan.problem
        block_m = self.block_m(plan)
        rows = p.batch_heads * padded_rows(p.seq_len, block_m)
        split = self.group_split(plan)
        partial = 2 * p.batch_kv_heads * split * p.kv_len * p.head_dim if split > 1 else 0
        return BackwardScratch(
            lse_log2=F32_BYTES * rows,
            delta=F32_BYTES * rows,
            dq_accum=F32_BYTES * self.dq_accumulator_elements(plan),
            counters=4 * rows // block_m if self.deterministic(plan) else 0,
            dkv_partial=F32_BYTES * partial,
        )

    def launches(
        self, plan: KernelPlan, buffers: DeviceBuffers | BackwardBuffers
    ) -> tuple[KernelLaunch, ...]:
        if not isinstance(buffers, BackwardBuffers):
            raise TypeError(f"{plan.key()} is a backward plan: its launches take BackwardBuffers")
        p = plan.problem
        deterministic = self.deterministic(plan)
        split = self.group_split(plan)
        rows = p.batch_heads * padded_rows(p.seq_len, self.block_m(plan))
        launches = [
            KernelLaunch(
                self.preprocess_function,
                (div_ceil(rows, PREPROCESS_ROWS_PER_BLOCK), 1, 1),
                (PREPROCESS_THREADS, 1, 1),
                0,
                (
                    np.uintp(buffers.out),
                    np.uintp(buffers.dout),
                    np.uintp(buffers.lse),
                    np.uintp(buffers.lse_log2),
                    np.uintp(buffers.delta),
                    np.uintp(buffers.dq_accum),
                    np.uintp(buffers.counters if deterministic else 0),
                    np.int32(p.seq_len),
                    np.int32(p.batch_heads),
                ),
            ),
            KernelLaunch(
                self.entry_functions[0],
                plan.launch.grid,
                plan.launch.block,
                plan.launch.shared_bytes,
                self.main_arguments(plan, buffers),
            ),
        ]
        launches.append(self.dq_launch(plan, buffers))
        if split > 1:
            kv_quads = p.batch_kv_heads * p.kv_len * p.head_dim // 4
            launches.append(
                KernelLaunch(
                    self.dkv_function,
                    (div_ceil(kv_quads, POSTPROCESS_THREADS), 1, 1),
                    (POSTPROCESS_THREADS, 1, 1),
                    0,
                    (
                        np.uintp(buffers.dkv_partial),
                        np.uintp(buffers.dk),
                        np.uintp(buffers.dv),
                        np.int32(p.kv_len),
                        np.int32(split),
                        np.int32(p.batch_kv_heads),
                    ),
                )
            )
        if p.sinks:
            launches.append(
                KernelLaunch(
                    self.sinks_function,
                    (p.heads, 1, 1),
                    (SINK_THREADS, 1, 1),
                    0,
                    (
                        np.uintp(buffers.lse_log2),
                        np.uintp(buffers.delta),
                        np.uintp(buffers.sinks),
                        np.uintp(buffers.d_sinks),
                        np.int32(p.seq_len),
                        np.int32(p.batch),
                        np.int32(p.heads),
                    ),
                )
            )
        return tuple(launches)
