"""Adding a kernel family touches only its planning module, its source and one registration.

A throwaway bf16 family, defined and registered here (nothing else in the
project changes), flows through the candidate space, the study space, the
cost model, the compile spec, the buffers and the launch sequence, and the
float32 families are ruled out of a half problem with a one-line reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import optuna
import pytest

from kernels import build
from kernels.launch import DeviceBuffers, buffer_elements, launch_sequence
from tuner.costmodel import predict
from tuner.device import H200, DeviceProfile
from tuner.planner import families
from tuner.planner.families.base import (
    CostTerms,
    KernelFamily,
    Tunable,
    executed_pairs,
    with_split_merge,
)
from tuner.planner.launches import KernelLaunch, kernel_launch, pointers, scale_log2
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, blocks_per_sm_of, occupancy_and_waves
from tuner.planner.space import SpaceAxes, candidate_space
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem
from tuner.study_space import StudySpace

PROBLEM = Problem(4096, 128, dtype="bfloat16")


class ToyMma(KernelFamily):
    """Shaped like the mma_f16 spec: block_m x block_n tiles, warps, stages, a split merge
    whose statistics are one log-sum-exp per row."""

    name = "toy_mma"
    source = "toy_mma.cu"
    entry_functions = ("toy_attention", "toy_split_merge")
    dtypes = ("bfloat16", "float16")
    arch = "sm_90a"
    nvcc_flags = ("--use_fast_math",)
    partial_stats_per_row = 1
    heatmap_axes = ("block_n", "block_m")
    tunables = (
        Tunable("block_m", 64, (64, 128)),
        Tunable("block_n", 64, (32, 64, 128)),
        Tunable("warps", 4, (4, 8)),
        Tunable("stages", 2, (2, 3)),
        Tunable("split_target", 1 << 16, (4, 1 << 16)),
    )

    def plan(self, problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
        n, d, bh = problem.seq_len, problem.head_dim, problem.batch_heads
        tile_count = -(-n // params.block_n)
        splits = max(1, -(-tile_count // params.split_target))
        tiles_per_split = -(-tile_count // splits)
        threads = 32 * params.warps
        shared = 2 * (d + 8) * (params.block_m + 2 * params.stages * params.block_n)
        launch = Launch((-(-n // params.block_m), splits, bh), (threads, 1, 1), shared)
        merge = None
        if splits > 1:
            merge = Launch((-(-(bh * n * d // 4) // 128), 1, 1), (128, 1, 1), 0)
        reason = ""
        if shared > device.max_shared_memory_per_block_optin:
            reason = f"shared memory {shared} B exceeds the opt-in limit"
        blocks = blocks_per_sm_of(threads, shared, None, device)
        occupancy, waves = occupancy_and_waves(launch, threads, blocks, device)
        element = problem.element_bytes
        return KernelPlan(
            problem=problem,
            params=params,
            tile_size=params.block_n,
            tile_count=tile_count,
            sequence_splits=splits,
            tiles_per_sequence_split=tiles_per_split,
            keys_per_sequence_split=min(n, tiles_per_split * params.block_n),
            split_reduce_scratch_elements=0,
            parallel_workgroups_per_row=splits,
            rows_per_block=params.block_m,
            threads_per_row=1,
            rows_per_thread=1,
            launch=launch,
            reduce_launch=merge,
            global_read_bytes=element * bh * n * d * 3,
            global_write_bytes=element * bh * n * d,
            matmul_flops=problem.useful_flops,
            non_matmul_flops=bh * problem.attended_pairs * 4,
            blocks_per_sm=blocks,
            occupancy=occupancy,
            waves=waves,
            feasible=not reason,
            reason=reason,
        )

    def compile_defines(self, plan: KernelPlan) -> dict[str, int]:
        p = plan.params
        return {
            "HEAD_DIM": plan.problem.head_dim,
            "BLOCK_M": p.block_m,
            "BLOCK_N": p.block_n,
            "WARPS": p.warps,
            "STAGES": p.stages,
            "CAUSAL": int(plan.problem.causal),
            "IS_FP16": int(plan.problem.dtype == "float16"),
        }

    def key(self, plan: KernelPlan) -> str:
        p = plan.params
        return f"toy_mma/m{p.block_m}/n{p.block_n}/w{p.warps}/st{p.stages}/s{plan.sequence_splits}"

    def launches(self, plan: KernelPlan, buffers: DeviceBuffers) -> tuple[KernelLaunch, ...]:
        q, k, v, out, partial_o, partial_lse = pointers(buffers)
        p = plan.problem
        seq_len = np.int32(p.seq_len)
        attention = kernel_launch(
            plan.launch,
            "toy_attention",
            (
                q,
                k,
                v,
                out,
                partial_o,
                partial_lse,
                seq_len,
                seq_len,
                np.int32(plan.keys_per_sequence_split),
                np.float32(scale_log2(p.head_dim)),
            ),
        )
        return with_split_merge(plan, attention, "toy_split_merge", buffers)

    def cost_terms(self, plan: KernelPlan) -> CostTerms:
        executed = executed_pairs(plan, plan.rows_per_block)
        return CostTerms("mma_sync_f16", executed, plan.problem.batch_heads * executed, 0, 0, 16)


@pytest.fixture
def toy() -> Iterator[KernelFamily]:
    # The real half-precision families step aside, so the space of a bfloat16
    # problem is the toy's alone; they come back in their registration order.
    kept = families.registered()
    for family in kept:
        if PROBLEM.dtype in family.dtypes:
            families.unregister(family.name)
    family = families.register(ToyMma())
    try:
        yield family
    finally:
        families.unregister(family.name)
        for name in families.family_names():
            families.unregister(name)
        for original in kept:
            families.register(original)


def test_a_registered_family_flows_through_the_space_and_the_study(toy: KernelFamily) -> None:
    space = candidate_space(PROBLEM, H200)
    assert {plan.family for plan in space.feasible} == {"toy_mma"}
    # 2 x 3 x 2 x 2 tunable combinations, each with and without a split, but for the
    # 2 x 2 (split or not) with block_m=128, block_n=128, stages=3: 243712 B of shared memory.
    assert len(space.feasible) == 2 * 3 * 2 * 2 * 2 - 4
    # The float32 families are not candidates of a bfloat16 problem at all; asked
    # directly, the planner refuses them with one line naming the dtype.
    assert {plan.family for plan in space.rejected} == {"toy_mma"}
    assert plan_kernel(PROBLEM, KernelParams("tiled"), H200).reason == (
        "tiled kernels take float32, not bfloat16"
    )
    narrowed = candidate_space(PROBLEM, H200, SpaceAxes(values={"toy_mma_block_m": (128,)}))
    assert {plan.params.block_m for plan in narrowed.feasible} == {128}

    study_space = StudySpace(PROBLEM, H200, space.feasible, space.rejected)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    point = study_space.suggest(trial)
    assert isinstance(point, KernelParams) and point.family == "toy_mma"
    assert set(trial.params) == {
        "family",
        "toy_mma.block_m",
        "toy_mma.block_n",
        "toy_mma.warps",
        "toy_mma.stages",
        "toy_mma.split_target",
    }
    resolved = study_space.resolve(point)
    assert resolved.plan is not None and resolved.plan.params == point
    fixed = study_space.fixed_params(space.feasible[0])
    assert fixed["family"] == "toy_mma" and fixed["toy_mma.block_n"] == 32


def test_a_registered_family_is_built_and_launched_as_it_says(toy: KernelFamily) -> None:
    split = next(p for p in candidate_space(PROBLEM, H200).feasible if p.sequence_splits > 1)
    spec = build.KernelSpec.from_plan(split)
    assert spec.family == "toy_mma" and dict(spec.defines)["IS_FP16"] == 0
    assert spec.arch("sm_90") == "sm_90a" and spec.nvcc_flags[-1] == "--use_fast_math"
    assert build.source_path("toy_mma").name == "toy_mma.cu"
    assert build.entry_functions("toy_mma") == ("toy_attention", "toy_split_merge")
    assert build.sources()["toy_mma"] == "toy_mma.cu"

    sizes = buffer_elements(split)
    rows = PROBLEM.batch_heads * split.sequence_splits * PROBLEM.seq_len
    assert sizes.element_bytes == 2 and sizes.tensor_bytes == PROBLEM.tensor_bytes
    assert sizes.partial_o == rows * PROBLEM.head_dim and sizes.partial_ml == rows  # lse: 1/row
    assert sizes.partial_o_bytes == 4 * sizes.partial_o  # float32 scratch
    assert split.partial_elements == sizes.partial_o + sizes.partial_ml

    buffers = DeviceBuffers(1, 2, 3, 4, partial_o=5, partial_ml=6)
    attention, merge = launch_sequence(split, buffers)
    assert attention.function == "toy_attention" and merge.function == "toy_split_merge"
    assert attention.args[:6] == tuple(np.uintp(a) for a in (1, 2, 3, 4, 5, 6))
    assert attention.grid == split.launch.grid and attention.needs_shared_opt_in

    prediction = predict(split, H200)
    assert 0 < prediction.time_ms < float("inf") and prediction.merge_ms > 0


def test_the_tensor_core_pipe_is_held_to_the_mma_sync_rate(toy: KernelFamily) -> None:
    plan = candidate_space(PROBLEM, H200).feasible[0]
    faster = predict(plan, H200)
    from dataclasses import replace

    slower = predict(plan, replace(H200, peak_mma_f16_tflops=H200.peak_mma_f16_tflops / 10))
    assert slower.compute_ms > faster.compute_ms


def test_params_are_per_family_and_old_rows_stay_readable() -> None:
    params = KernelParams("tiled", 256, 64, 64, 4)
    assert params.as_dict() == {
        "family": "tiled",
        "threads": 256,
        "tile_size": 64,
        "rows_per_block": 64,
        "split_target": 4,
    }
    assert params == KernelParams("tiled", threads=256, tile_size=64, rows_per_block=64)
    assert hash(params) == hash(KernelParams("tiled", 256, 64, 64, 4))
    # A scalar_online row written when every family carried every tunable.
    old = {"threads": 128, "tile_size": 1, "rows_per_block": 1, "split_target": 4}
    assert KernelParams.from_stored("scalar_online", old).as_dict() == {
        "family": "scalar_online",
        "threads": 128,
    }
    with pytest.raises(ValueError, match="no tunable 'warps'"):
        KernelParams("tiled", warps=4)
    with pytest.raises(ValueError, match="unknown kernel family 'nope'"):
        KernelParams("nope")
