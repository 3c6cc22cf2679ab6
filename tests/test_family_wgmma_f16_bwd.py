"""The wgmma_f16_bwd family (the Hopper backward): feasibility with reasons, the kernel's
shared-memory layout, the launches and their argument types against the kernel's signatures,
its tiled dQ accumulator (scratch size, the preprocess's zeroing and the cast's grid), and the
cost terms. Pure: no GPU, no compiler."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_launch_config import kernel_signatures

from kernels import build
from tuner.costmodel import predict, predict_time_ms
from tuner.device import H200
from tuner.planner.families import family_named
from tuner.planner.families.backward_base import padded_rows
from tuner.planner.families.wgmma_f16_bwd import wgmma_f16_bwd_shared_bytes
from tuner.planner.launches import BackwardBuffers, DeviceBuffers
from tuner.planner.params import KernelParams
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem

FAMILY = family_named("wgmma_f16_bwd")
BACKWARD = Problem(4096, 128, batch=4, heads=16, dtype="bfloat16", direction="backward")
MARKERS = BackwardBuffers(*(1000 + 16 * i for i in range(17)))


def plan(problem: Problem = BACKWARD, device=H200, **tunables: int):
    return plan_kernel(problem, KernelParams("wgmma_f16_bwd", **tunables), device)


def test_shared_bytes_and_grid_follow_the_kernels_layout() -> None:
    # K, V (128 keys), two stages of Q and dO (64 rows), dS (64 x 128), two stages of the float
    # rows, the dQ staging (8 warps x 16 rows x 64 floats), the 1024-byte alignment slack
    bytes_ = 2 * (2 * 128 * 128 + 4 * 64 * 128 + 64 * 128) + 4 * (4 * 64 + 8 * 16 * 64) + 1024
    assert wgmma_f16_bwd_shared_bytes(64, 128) == bytes_ == 182272
    p = plan()
    assert p.feasible and p.launch.shared_bytes == bytes_
    assert p.launch.grid == (32, 1, 64) and p.launch.block == (256, 1, 1)
    assert p.blocks_per_sm == 1
    gqa = Problem(4096, 128, batch=2, heads=32, kv_heads=8, dtype="bfloat16", direction="backward")
    assert plan(gqa, group_split=2).launch.grid == (32, 2, 16)
    assert plan(gqa).key() == "wgmma_f16_bwd/m64/atomic/g1"
    assert plan(gqa, deterministic=1, group_split=4).key() == "wgmma_f16_bwd/m64/det/g4"


@pytest.mark.parametrize(
    ("tunables", "problem", "words"),
    [
        ({"group_split": 2}, BACKWARD, "does not divide the 1 query heads"),
        ({"block_m": 128}, BACKWARD, "64 query rows a step"),
        ({"deterministic": 2}, BACKWARD, "not 0 (atomic dQ) or 1"),
        ({}, dataclasses.replace(BACKWARD, head_dim=96), "is not one of (64, 128)"),
        ({}, dataclasses.replace(BACKWARD, dtype="float32"), "not float32"),
        ({}, dataclasses.replace(BACKWARD, direction="forward"), "not the forward pass"),
    ],
)
def test_infeasible_plans_say_why_in_one_line(tunables, problem, words) -> None:
    p = plan(problem, **tunables)
    assert not p.feasible and words in p.reason and "\n" not in p.reason


def test_it_needs_hopper() -> None:
    p = plan(device=dataclasses.replace(H200, compute_capability=(8, 0)))
    assert not p.feasible and "sm_90a" in p.reason
    assert FAMILY.arch == "sm_90a"


@pytest.mark.parametrize("deterministic", [0, 1])
@pytest.mark.parametrize(
    "problem",
    [
        BACKWARD,
        Problem(77, 64, heads=4, kv_heads=1, causal=True, dtype="float16", kv_len=100,
                direction="backward", sinks=True, softcap=30.0),
    ],
)  # fmt: skip
def test_launches_carry_the_plans_buffers_in_the_kernels_signatures(problem, deterministic):
    split = 2 if problem.group > 1 else 1
    p = plan(problem, deterministic=deterministic, group_split=split)
    assert p.feasible, p.reason
    launches = FAMILY.launches(p, MARKERS)
    names = [launch.function for launch in launches]
    expected = ["wgmma_f16_bwd_preprocess", "wgmma_f16_bwd_attention", "wgmma_f16_bwd_dq"]
    expected += ["wgmma_f16_bwd_dkv"] * (split > 1) + ["wgmma_f16_bwd_sinks"] * problem.sinks
    assert names == expected and set(names) <= set(build.ENTRY_FUNCTIONS["wgmma_f16_bwd"])
    signatures = kernel_signatures()
    for launch in launches:
        assert [type(a) for a in launch.args] == signatures[launch.function], launch.function
    pre, main, dq = launches[:3]
    rows = problem.batch_heads * padded_rows(problem.seq_len, 64)
    assert pre.grid[0] * 4 >= rows and pre.block == (128, 1, 1)
    assert pre.args[6] == (MARKERS.counters if deterministic else 0)
    assert main.grid == p.launch.grid and main.shared_bytes == p.launch.shared_bytes
    assert main.args[9] == (MARKERS.dkv_partial if split > 1 else 0)
    assert main.args[10] == (MARKERS.counters if deterministic else 0)
    # the cast walks the tiled accumulator (padded rows too), a thread per 4 floats
    assert dq.grid[0] * 128 * 4 >= rows * problem.head_dim > (dq.grid[0] - 1) * 128 * 4
    assert dq.args[2:4] == (problem.seq_len, problem.batch_heads)
    assert dq.args[4] == np.float32(1 / np.sqrt(problem.head_dim))
    with pytest.raises(TypeError, match="BackwardBuffers"):
        FAMILY.launches(p, DeviceBuffers(1, 2, 3, 4))


def test_scratch_holds_the_tiled_accumulator() -> None:
    gqa = Problem(100, 64, batch=2, heads=8, kv_heads=2, kv_len=130, dtype="bfloat16",
                  direction="backward")  # fmt: skip
    scratch = FAMILY.backward_scratch(plan(gqa, deterministic=1, group_split=4))
    rows = 2 * 8 * 128  # 100 rows padded to two 64-row blocks
    assert (scratch.lse_log2, scratch.delta) == (4 * rows, 4 * rows)
    assert scratch.dq_accum == 4 * rows * 64  # the padded rows' tiles too
    assert scratch.counters == 4 * rows // 64
    assert scratch.dkv_partial == 4 * 2 * 2 * 2 * 4 * 130 * 64


def test_cost_terms_count_five_products_a_pair_on_wgmma() -> None:
    p = plan()
    terms = FAMILY.cost_terms(p)
    assert terms.matmuls_per_pair == 5 and terms.matmul_pipe == "wgmma_f16"
    assert terms.executed_pairs == 4096 * 4096
    assert predict(p, H200).executed_flops == BACKWARD.useful_flops
    causal = dataclasses.replace(BACKWARD, causal=True)
    half = FAMILY.cost_terms(plan(causal)).executed_pairs
    assert 0.5 < half / terms.executed_pairs < 0.52
    # on wgmma it is predicted ahead of the mma.sync backward, the deterministic order behind
    mma = plan_kernel(BACKWARD, KernelParams("mma_f16_bwd", block_m=128, stages=1, q_chunk=32),
                      H200)  # fmt: skip
    assert predict_time_ms(p, H200) < predict_time_ms(mma, H200)
    assert predict_time_ms(plan(deterministic=1), H200) > predict_time_ms(p, H200)
