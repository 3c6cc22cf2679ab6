"""A throwaway float32 family on the variant ABI, and its kernel emulated for the fake GPUs.

The split-KV families' attention entry takes, after the six buffers of today,

    (seq_len, kv_len, group, keys_per_split, scale_log2, heads, window_left, window_right,
     softcap, alibi_slopes, sinks, lse)

(``heads`` the query heads, -1 an unbounded window side, softcap 0 off, the slope, sink and
LSE pointers 0 when off). ``ToyVariants`` launches one such entry and nothing else, so the
tuning backend and the deploy path can be driven end to end with every variant on a fake GPU
(``test_pycuda_backend.make_driver``), before any real family's kernels take them.
``emulated_attention`` is that entry in float64 (``kernels.reference``); ``ignore`` names a
variant it leaves out, the kernel bug a parity check must catch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kernels.attention_variants import LOG2E, VariantValues
from kernels.reference import attention_reference
from tuner.device import DeviceProfile
from tuner.planner import families
from tuner.planner.families.base import CostTerms, KernelFamily, Tunable, executed_pairs
from tuner.planner.launches import (
    DeviceBuffers,
    KernelLaunch,
    kernel_launch,
    pointers,
    scale_log2,
)
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.problem import Problem

NAME = "toy_variants"
ENTRY = "toy_variants_attention"


class ToyVariants(KernelFamily):
    """One block of ``threads`` threads per (row block, batch x head); no key splits."""

    name = NAME
    # Only hashed (the registry's source key); the tests' fake nvcc compiles nothing.
    source = "tiled.cu"
    entry_functions = (ENTRY,)
    dtypes = ("float32",)
    tunables = (Tunable("threads", 64, (64, 128)), Tunable("block_m", 16, (16, 32)))

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, m, bh = problem.seq_len, problem.kv_len, problem.batch_heads
        launch = Launch((-(-n // params.block_m), 1, bh), (params.threads, 1, 1), 4096)
        blocks = blocks_per_sm_of(params.threads, 4096, None, device)
        occupancy, waves = occupancy_and_waves(launch, params.threads, blocks, device)
        return KernelPlan(
            problem=problem,
            params=params,
            tile_size=m,
            tile_count=1,
            sequence_splits=1,
            tiles_per_sequence_split=1,
            keys_per_sequence_split=m,
            split_reduce_scratch_elements=0,
            parallel_workgroups_per_row=1,
            rows_per_block=params.block_m,
            threads_per_row=1,
            rows_per_thread=1,
            launch=launch,
            reduce_launch=None,
            global_read_bytes=problem.tensor_bytes + 2 * problem.kv_tensor_bytes,
            global_write_bytes=problem.tensor_bytes,
            matmul_flops=problem.useful_flops,
            non_matmul_flops=bh * problem.attended_pairs * 4,
            blocks_per_sm=blocks,
            occupancy=occupancy,
            waves=waves,
            feasible=True,
            reason="",
        )

    def compile_defines(self, plan: KernelPlan) -> dict[str, int]:
        return {
            "HEAD_DIM": plan.problem.head_dim,
            "THREADS": plan.params.threads,
            "BLOCK_M": plan.params.block_m,
            "CAUSAL": int(plan.problem.causal),
        }

    def key(self, plan: KernelPlan) -> str:
        return f"{NAME}/t{plan.params.threads}/m{plan.params.block_m}"

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        p = plan.problem
        return (
            kernel_launch(
                plan.launch,
                ENTRY,
                (
                    *pointers(buffers),
                    np.int32(p.seq_len),
                    np.int32(p.kv_len),
                    np.int32(p.group),
                    np.int32(plan.keys_per_sequence_split),
                    np.float32(scale_log2(p.head_dim)),
                    np.int32(p.heads),
                    np.int32(p.window_left),
                    np.int32(p.window_right),
                    np.float32(p.softcap),
                    np.uintp(buffers.alibi_slopes),
                    np.uintp(buffers.sinks),
                    np.uintp(buffers.lse),
                ),
            ),
        )

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        executed = executed_pairs(plan, plan.rows_per_block)
        return CostTerms("ffma", executed, plan.problem.batch_heads * executed, 0, 0, 4)


@contextmanager
def toy_variants_only() -> Iterator[KernelFamily]:
    """The float32 families step aside for the toy; all come back in their order after."""
    kept = families.registered()
    for family in kept:
        if "float32" in family.dtypes:
            families.unregister(family.name)
    family = families.register(ToyVariants())
    try:
        yield family
    finally:
        for name in families.family_names():
            families.unregister(name)
        for original in kept:
            families.register(original)


def emulated_attention(
    gpu: Any,
    defines: dict[str, int],
    grid: tuple[int, int, int],
    q, k, v, out, partial_o, partial_lse,
    seq_len, kv_len, group, keys_per_split, scale, heads,
    window_left, window_right, softcap, alibi_slopes, sinks, lse,
    ignore: str = "",
) -> None:
    """``toy_variants_attention`` on the fake GPU (``gpu.floats(address, count)`` views its
    float32 memory), in float64; ``ignore``: a variant left out ("window", "softcap",
    "alibi", "sinks", "scale")."""
    n, m, d, bh = int(seq_len), int(kv_len), defines["HEAD_DIM"], grid[2]
    h = int(heads)
    kv_bh = bh // int(group)
    q3 = gpu.floats(q, bh * n * d).reshape(bh, n, d)
    k3, v3 = (gpu.floats(a, kv_bh * m * d).reshape(kv_bh, m, d) for a in (k, v))
    variants = VariantValues(
        window_left=-1 if ignore == "window" else int(window_left),
        window_right=-1 if ignore == "window" else int(window_right),
        softcap=0.0 if ignore == "softcap" else float(softcap),
        alibi_slopes=(
            gpu.floats(alibi_slopes, h).astype(np.float64)
            if int(alibi_slopes) and ignore != "alibi"
            else None
        ),
        sinks=gpu.floats(sinks, h).astype(np.float64) if int(sinks) and ignore != "sinks" else None,
        scale=(1 / np.sqrt(d)) if ignore == "scale" else float(scale) / LOG2E,
    )
    result, rows_lse = attention_reference(
        q3, k3, v3, bool(defines["CAUSAL"]), int(group), variants, lse=True
    )
    gpu.floats(out, bh * n * d)[:] = result.reshape(-1)
    if int(lse):
        gpu.floats(lse, bh * n)[:] = rows_lse.reshape(-1)
