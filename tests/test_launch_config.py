"""The launches the PyCUDA backend makes are the plan's, and their arguments fit the kernels.

``kernels.launch.launch_sequence`` is the pure function the backend launches
from, so these tests need no GPU: grid, block and shared bytes equal the
plan's (the seed's third test, on the launch side), arguments match the
``extern "C"`` signatures in the ``.cu`` files, and importing the backend
loads no pycuda.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kernel_signatures import kernel_signatures

from kernels import build
from kernels.launch import (
    DEFAULT_DYNAMIC_SHARED_LIMIT,
    DeviceBuffers,
    buffer_elements,
    launch_sequence,
)
from kernels.reference import scale_log2
from tuner.device import H200
from tuner.planner.families.decode_f16 import decode_f16_shared_bytes
from tuner.planner.families.mma_f16 import mma_f16_shared_bytes
from tuner.planner.families.mma_tf32 import mma_tf32_shared_bytes
from tuner.planner.families.wgmma_f16 import wgmma_f16_shared_bytes
from tuner.planner.launches import KernelLaunch, TensorMap
from tuner.planner.space import candidate_space
from tuner.planner.tunable import (
    KernelParams,
    KernelPlan,
    plan_kernel,
    scalar_shared_bytes,
    tiled_shared_bytes,
)
from tuner.problem import Problem

BUFFERS = DeviceBuffers(
    q=0x1000,
    k=0x2000,
    v=0x3000,
    out=0x4000,
    partial_o=0x5000,
    partial_ml=0x6000,
    alibi_slopes=0x7000,
    sinks=0x8000,
    lse=0x9000,
)
PROBLEMS = [
    Problem(4096, 128),
    Problem(4096, 128, causal=True),
    Problem(1000, 64, batch=2, heads=3),
    Problem(65, 32, causal=True),
    Problem(1000, 128, heads=2, dtype="bfloat16"),
    Problem(65, 64, causal=True, dtype="float16"),
    # grouped-query attention, decode against a KV cache, MQA
    Problem(1, 128, batch=2, heads=8, dtype="bfloat16", kv_heads=2, kv_len=1000),
    Problem(7, 64, heads=4, causal=True, dtype="float16", kv_heads=1, kv_len=300),
    Problem(100, 32, heads=4, causal=True, kv_heads=2, kv_len=250),
]
def all_plans() -> list[KernelPlan]:
    plans: list[KernelPlan] = []
    for problem in PROBLEMS:
        plans += candidate_space(problem, H200).feasible
    return plans


def test_signatures_are_found_for_every_entry_function() -> None:
    signatures = kernel_signatures()
    assert set(signatures) == {name for names in build.ENTRY_FUNCTIONS.values() for name in names}
    # The split-KV contract, then the variant arguments of kernels/include/fa/variant.cuh.
    contract = [np.uintp] * 6 + [np.int32] * 4 + [np.float32]
    variant = [np.int32] * 3 + [np.float32] + [np.uintp] * 3
    for family in ("tiled", "mma_f16", "decode_f16", "mma_tf32"):
        assert signatures[f"{family}_attention"] == contract + variant
    # wgmma_f16: led by its tensor maps, ended by batch_heads (its persistent queue)
    assert signatures["wgmma_f16_attention"] == [TensorMap] * 3 + contract + variant + [np.int32]
    # with TMA stores (staged_store=2) a fourth map, the output's, follows v's
    tma_stores = kernel_signatures({"STAGED_STORE": 2})["wgmma_f16_attention"]
    assert tma_stores == [TensorMap] * 4 + contract + variant + [np.int32]
    merge = [np.uintp] * 3 + [np.int32] * 4 + [np.uintp] * 2
    for name in ("split_merge", "mma_f16_split_merge", "decode_f16_split_merge"):
        assert signatures[name] == merge
    # serving_f16: q, caches, out, scratch, work list, pages; its offsets, kv_heads, page_size
    serving = [np.uintp] * 8 + [np.int32] * 5 + [np.float32]
    assert signatures["serving_f16_attention"] == serving + variant
    assert signatures["serving_f16_split_merge"] == [np.uintp] * 4 + [np.int32] * 2 + [
        np.uintp
    ] * 2


def contract_args(launch: KernelLaunch) -> tuple:
    """A launch's arguments after its leading TMA descriptors (the split-KV contract's)."""
    leading = 0
    while leading < len(launch.args) and isinstance(launch.args[leading], TensorMap):
        leading += 1
    return launch.args[leading:]


def check_launch(plan: KernelPlan) -> None:
    launches = launch_sequence(plan, BUFFERS)
    main = launches[0]
    assert main.function == build.ENTRY_FUNCTIONS[plan.family][0]
    assert main.grid == plan.launch.grid
    assert main.block == (plan.threads, 1, 1)
    assert main.shared_bytes == plan.launch.shared_bytes
    assert main.needs_shared_opt_in == (main.shared_bytes > DEFAULT_DYNAMIC_SHARED_LIMIT)
    p = plan.problem
    if plan.family == "tiled":
        assert main.shared_bytes == tiled_shared_bytes(
            plan.rows_per_block, plan.tile_size, p.head_dim
        )
        assert main.grid == (
            -(-p.seq_len // plan.rows_per_block),
            plan.sequence_splits,
            p.batch_heads,
        )
        assert (main.args[6], main.args[7], main.args[8]) == (p.seq_len, p.kv_len, p.group)
        assert main.args[9] == plan.keys_per_sequence_split
    elif plan.family in ("mma_f16", "mma_tf32"):
        shared_bytes = mma_f16_shared_bytes if plan.family == "mma_f16" else mma_tf32_shared_bytes
        assert main.shared_bytes == shared_bytes(
            plan.params.block_m, plan.params.block_n, plan.params.stages, p.head_dim
        )
        row_blocks = -(-p.seq_len // plan.params.block_m)
        assert main.grid == (row_blocks, plan.sequence_splits, p.batch_heads)
        assert (main.args[6], main.args[7], main.args[8]) == (p.seq_len, p.kv_len, p.group)
        assert main.args[9] == plan.keys_per_sequence_split
        assert plan.keys_per_sequence_split % plan.params.block_n == 0
    elif plan.family == "wgmma_f16":
        assert main.shared_bytes == wgmma_f16_shared_bytes(
            plan.params.consumers, plan.params.block_n, plan.params.stages, p.head_dim
        )
        row_blocks = -(-p.seq_len // plan.rows_per_block)
        assert main.grid == (row_blocks, plan.sequence_splits, p.batch_heads)
        assert [m.buffer for m in main.args[:3]] == ["q", "k", "v"]
        assert [m.address for m in main.args[:3]] == [BUFFERS.q, BUFFERS.k, BUFFERS.v]
        args = contract_args(main)
        assert (args[6], args[7], args[8]) == (p.seq_len, p.kv_len, p.group)
        assert args[9] == plan.keys_per_sequence_split
        assert plan.keys_per_sequence_split % plan.params.block_n == 0
    elif plan.family == "decode_f16":
        assert main.shared_bytes == decode_f16_shared_bytes(
            plan.rows_per_block, plan.params.block_n, plan.params.stages, plan.params.warps,
            p.head_dim,
        )
        row_blocks = -(-p.group * p.seq_len // plan.rows_per_block)
        assert main.grid == (row_blocks, plan.sequence_splits, p.batch_kv_heads)
        assert (main.args[6], main.args[7], main.args[8]) == (p.seq_len, p.kv_len, p.group)
        assert main.args[9] == plan.keys_per_sequence_split
        assert plan.keys_per_sequence_split % plan.params.block_n == 0
    else:
        assert main.shared_bytes == scalar_shared_bytes(plan.threads, p.head_dim)
        assert main.grid == (-(-p.seq_len // plan.threads), 1, p.batch_heads)
    signatures = kernel_signatures(plan.compile_defines())
    for launch in launches:
        assert [type(a) for a in launch.args] == signatures[launch.function]
    assert len(launches) == (2 if plan.sequence_splits > 1 else 1)


def test_launch_is_the_plans() -> None:
    """Every feasible plan of four problems (full, causal, batched, odd length)."""
    plans = all_plans()
    assert len(plans) > 1000
    for plan in plans:
        try:
            check_launch(plan)
        except AssertionError as error:
            raise AssertionError(f"{plan.problem.label()} {plan.key()}: {error}") from error


def test_split_plans_merge_with_the_reduce_launch() -> None:
    plans = [p for p in all_plans() if p.sequence_splits > 1]
    assert plans
    for plan in plans:
        attention, merge = launch_sequence(plan, BUFFERS)
        p = plan.problem
        assert merge.function == build.ENTRY_FUNCTIONS[plan.family][1]
        assert plan.reduce_launch is not None
        assert (merge.grid, merge.block, merge.shared_bytes) == (
            plan.reduce_launch.grid,
            plan.reduce_launch.block,
            0,
        )
        # One thread per float4 of output, all covered.
        assert merge.grid[0] * merge.block[0] >= p.batch_heads * p.seq_len * p.head_dim // 4
        partial_o, partial_ml, out, seq_len, splits, rows, heads, sinks, lse = merge.args
        assert (partial_o, partial_ml, out) == (BUFFERS.partial_o, BUFFERS.partial_ml, BUFFERS.out)
        assert (seq_len, splits, rows, heads) == (
            p.seq_len,
            plan.sequence_splits,
            p.batch_heads * p.seq_len,
            p.heads,
        )
        assert (sinks, lse) == (BUFFERS.sinks, BUFFERS.lse)
        assert contract_args(attention)[4:6] == (BUFFERS.partial_o, BUFFERS.partial_ml)


def test_split_buffers_are_the_plans_scratch() -> None:
    for plan in all_plans():
        sizes = buffer_elements(plan)
        p = plan.problem
        assert sizes.tensor == p.batch_heads * p.seq_len * p.head_dim
        assert sizes.partial_o + sizes.partial_ml == plan.partial_elements
        if plan.sequence_splits > 1:
            # the shared merge's contract: one log2-sum-exp per row and split beside the
            # row's head_dim accumulators
            per_row = plan.sequence_splits * (p.head_dim + 1)
            assert sizes.partial_o + sizes.partial_ml == p.batch_heads * p.seq_len * per_row


def test_arguments_carry_the_buffers_and_the_log2_scale() -> None:
    plan = plan_kernel(Problem(64, 32), KernelParams("scalar_online", threads=64), H200)
    (launch,) = launch_sequence(plan, BUFFERS)
    q, k, v, out, seq_len, kv_len, group, scale = launch.args
    assert (q, k, v, out) == (BUFFERS.q, BUFFERS.k, BUFFERS.v, BUFFERS.out)
    assert seq_len == kv_len == 64 and group == 1
    assert scale == np.float32(scale_log2(32))


def test_the_seeds_builder_shapes() -> None:
    """The seed's third test, on the launch side: scalar (9, 7) and tiled (8, 16, tile 4)."""
    scalar = plan_kernel(Problem(9, 7), KernelParams("scalar_online", threads=32), H200)
    (launch,) = launch_sequence(scalar, BUFFERS)
    assert launch.block[0] == scalar.threads
    assert launch.shared_bytes == scalar.threads * 7 * 4  # the o accumulator scratch
    tiled = plan_kernel(
        Problem(8, 16), KernelParams("tiled", threads=32, tile_size=4, rows_per_block=4), H200
    )
    (launch,) = launch_sequence(tiled, BUFFERS)
    assert launch.block[0] == tiled.threads
    assert launch.shared_bytes == tiled_shared_bytes(4, 4, 16)


def test_a_split_plan_without_split_buffers_is_refused() -> None:
    plan = next(p for p in all_plans() if p.sequence_splits > 1)
    with pytest.raises(ValueError, match="split buffers"):
        launch_sequence(plan, DeviceBuffers(q=1, k=2, v=3, out=4))


def test_importing_the_kernels_package_and_backend_loads_no_pycuda() -> None:
    code = (
        "import sys\n"
        "import kernels, kernels.build, kernels.launch, kernels.parity, kernels.reference\n"
        "import kernels.timing, kernels.backends, kernels.backends.pycuda_backend\n"
        "from kernels.backends.pycuda_backend import PyCudaBackend\n"
        "PyCudaBackend(cache_dir='unused')\n"
        "loaded = [m for m in sys.modules if m == 'pycuda' or m.startswith('pycuda.')]\n"
        "assert not loaded, loaded\n"
        "print('clean')\n"
    )
    root = Path(build.__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"
