"""The cost model: its parts add up, and it moves in the obvious directions."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuner.costmodel import (
    LAUNCH_OVERHEAD_MS,
    CostParams,
    Prediction,
    calibrated,
    predict,
    predict_time_ms,
    rank_correlation,
)
from tuner.device import H200
from tuner.planner import KernelParams, KernelPlan, candidate_space, plan_kernel
from tuner.problem import Problem

PROBLEMS = [
    Problem(512, 64),
    Problem(4096, 128),
    Problem(2048, 64, batch=2, heads=4, causal=True),
]


def feasible_plans(problem: Problem) -> tuple[KernelPlan, ...]:
    return candidate_space(problem, H200).feasible


def tiled(problem: Problem, tile: int = 64, rows: int = 64, threads: int = 256, split: int = 4):
    plan = plan_kernel(problem, KernelParams("tiled", threads, tile, rows, split), H200)
    assert plan.feasible, plan.reason
    return plan


@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.label)
def test_every_feasible_plan_gets_a_finite_positive_time_made_of_its_parts(problem: Problem):
    for plan in feasible_plans(problem):
        prediction = predict(plan, H200)
        assert math.isfinite(prediction.time_ms) and prediction.time_ms > 0
        assert prediction.time_ms == pytest.approx(
            prediction.kernel_ms + prediction.merge_ms + prediction.launch_ms
        )
        bounds = (prediction.dram_ms, prediction.compute_ms, prediction.shared_ms)
        assert prediction.kernel_ms >= max(bounds) * (1 - 1e-12)
        assert prediction.slowdown >= 1.0
        assert 0 < prediction.latency_efficiency <= 1
        assert prediction.traffic_bytes == plan.global_bytes
        assert predict_time_ms(plan, H200) == prediction.time_ms


def test_split_merge_costs_a_second_launch_and_its_traffic():
    problem = Problem(4096, 128)
    single = tiled(problem, split=2**16)
    split = tiled(problem, split=4)
    assert single.sequence_splits == 1 and split.sequence_splits > 1
    assert predict(single, H200).launch_ms == pytest.approx(LAUNCH_OVERHEAD_MS)
    assert predict(single, H200).merge_ms == 0
    with_merge = predict(split, H200)
    assert with_merge.launch_ms == pytest.approx(2 * LAUNCH_OVERHEAD_MS)
    assert with_merge.merge_ms > 0


def test_an_unlaunchable_plan_is_infinitely_slow():
    plan = dataclasses.replace(tiled(Problem(1024, 64)), blocks_per_sm=0)
    assert predict(plan, H200).time_ms == math.inf


# ---------------------------------------------------------------- monotone directions

ALL_PLANS = [plan for problem in PROBLEMS for plan in feasible_plans(problem)]
plans = st.sampled_from(ALL_PLANS)
factors = st.floats(min_value=1.0, max_value=64.0)


@settings(max_examples=200, deadline=None)
@given(plans, factors)
def test_more_global_traffic_is_never_faster(plan: KernelPlan, factor: float):
    heavier = dataclasses.replace(
        plan,
        global_read_bytes=int(plan.global_read_bytes * factor),
        global_write_bytes=int(plan.global_write_bytes * factor),
    )
    assert predict_time_ms(heavier, H200) >= predict_time_ms(plan, H200)


@settings(max_examples=200, deadline=None)
@given(plans, factors)
def test_more_non_matmul_work_is_never_faster(plan: KernelPlan, factor: float):
    heavier = dataclasses.replace(plan, non_matmul_flops=int(plan.non_matmul_flops * factor))
    assert predict_time_ms(heavier, H200) >= predict_time_ms(plan, H200)


@settings(max_examples=200, deadline=None)
@given(plans, st.floats(min_value=0.05, max_value=1.0))
def test_a_slower_device_is_never_faster(plan: KernelPlan, scale: float):
    for field in ("dram_bandwidth_gbps", "peak_fp32_tflops", "clock_ghz"):
        slower = dataclasses.replace(H200, **{field: getattr(H200, field) * scale})
        assert predict_time_ms(plan, slower) >= predict_time_ms(plan, H200), field


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([p for p in ALL_PLANS if p.blocks_per_sm > 1]),
    st.integers(min_value=1, max_value=8),
)
def test_more_resident_blocks_per_sm_over_whole_waves_is_never_slower(
    plan: KernelPlan, whole_waves: int
):
    # Keep the block count a whole number of waves at either occupancy, so that
    # only latency hiding changes.
    fewer = plan.blocks_per_sm - 1
    blocks = whole_waves * plan.blocks_per_sm * fewer * H200.sm_count
    launch = dataclasses.replace(plan.launch, grid=(blocks, 1, 1))
    more = dataclasses.replace(plan, launch=launch)
    less = dataclasses.replace(more, blocks_per_sm=fewer)
    assert predict(more, H200).kernel_ms <= predict(less, H200).kernel_ms * (1 + 1e-12)


def test_latency_bound_waves_pay_the_classic_tail():
    # 64 threads, 1 block per SM: a round is latency bound, so 1.5 waves cost 2.
    # With the memory and SM sides combined by their maximum (a large overlap p;
    # the calibrated p-norm adds part of the memory side on top).
    plan = tiled(Problem(4096, 64), tile=128, rows=16, threads=64, split=2**16)
    blocks = int(1.5 * H200.sm_count)
    launch = dataclasses.replace(plan.launch, grid=(blocks, 1, 1))
    plan = dataclasses.replace(plan, blocks_per_sm=1, launch=launch)
    prediction = predict(plan, H200, CostParams(overlap=1000.0))
    expected = (2 / 1.5) / prediction.latency_efficiency
    sm_side = max(prediction.compute_ms, prediction.shared_ms)
    assert prediction.kernel_ms == pytest.approx(sm_side * expected)


def test_longer_sequences_and_wider_heads_are_never_faster():
    params = KernelParams("tiled", 256, 64, 64, 4)
    times = [
        predict_time_ms(plan_kernel(Problem(n, 64), params, H200), H200)
        for n in (512, 1024, 2048, 4096, 8192)
    ]
    assert times == sorted(times)
    narrow = predict_time_ms(plan_kernel(Problem(4096, 64), params, H200), H200)
    wide = predict_time_ms(plan_kernel(Problem(4096, 128), params, H200), H200)
    assert wide >= narrow


def test_causal_is_cheaper_than_full_attention():
    full = tiled(Problem(4096, 128))
    causal = tiled(Problem(4096, 128, causal=True))
    assert predict_time_ms(causal, H200) < predict_time_ms(full, H200)


def test_reuse_of_rows_per_block_is_rewarded_for_a_memory_bound_shape():
    # Short rows and many heads: K/V re-reads dominate; more rows per block
    # read them fewer times.
    problem = Problem(1024, 64, batch=4, heads=8)
    small = predict(tiled(problem, tile=32, rows=16, threads=64), H200)
    large = predict(tiled(problem, tile=32, rows=64, threads=256), H200)
    assert large.read_bytes < small.read_bytes
    assert large.dram_ms < small.dram_ms


def test_tiled_beats_scalar_on_a_long_sequence():
    predictions = [predict(plan, H200) for plan in feasible_plans(Problem(4096, 128))]
    by_family: dict[str, list[Prediction]] = {}
    for plan, prediction in zip(feasible_plans(Problem(4096, 128)), predictions, strict=True):
        by_family.setdefault(plan.family, []).append(prediction)
    best_tiled = min(p.time_ms for p in by_family["tiled"])
    best_scalar = min(p.time_ms for p in by_family["scalar_online"])
    assert best_tiled < best_scalar


# ---------------------------------------------------------------- rank correlation


def test_rank_correlation_of_perfect_and_reversed_orders():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Monotone, not linear: ranks only.
    assert rank_correlation([1, 2, 3, 4], [1, 10, 100, 1000]) == pytest.approx(1.0)


def test_rank_correlation_averages_ties_like_the_textbook():
    # scipy.stats.spearmanr([1, 2, 2, 3], [1, 3, 2, 4]).statistic == 0.9486832980505138
    assert rank_correlation([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)


def test_rank_correlation_drops_failed_pairs_and_needs_two():
    assert rank_correlation([1, 2, None, 3], [1, 2, 5, math.inf]) == pytest.approx(1.0)
    assert math.isnan(rank_correlation([1.0], [2.0]))
    assert math.isnan(rank_correlation([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        rank_correlation([1, 2], [1])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=3, max_size=30))
def test_rank_correlation_matches_numpy_pearson_of_ranks(values: list[float]):
    import numpy as np

    other = [v * v - 3 * v for v in values]
    rho = rank_correlation(values, other)

    def ranks(xs: list[float]) -> np.ndarray:
        array = np.asarray(xs)
        order = array.argsort(kind="stable")
        result = np.empty(len(xs))
        result[order] = np.arange(1, len(xs) + 1)
        for value in np.unique(array):  # average ranks of ties
            mask = array == value
            result[mask] = result[mask].mean()
        return result

    rx, ry = ranks(values), ranks(other)
    if rx.std() == 0 or ry.std() == 0:
        assert math.isnan(rho)
    else:
        assert rho == pytest.approx(float(np.corrcoef(rx, ry)[0, 1]), abs=1e-9)


# ---------------------------------------------------------------- occupancy and memory latency


def test_a_family_register_estimate_bounds_occupancy_until_the_compiler_reports():
    from tuner.costmodel import feature_table
    from tuner.planner.families.mma_f16 import mma_f16_registers
    from tuner.planner.plan import ResourceUsage

    problem = Problem(4096, 128, batch=4, heads=16, dtype="bfloat16")
    plan = plan_kernel(
        problem,
        KernelParams("mma_f16", block_m=64, block_n=32, warps=4, stages=2, split_target=2**16),
        H200,
    )
    assert plan.feasible and plan.resources is None
    estimate = mma_f16_registers(1, 1, 32, 128, False)
    assert 150 <= estimate <= 170  # ptxas: 160 (nvcc 13.0, sm_90)
    # 4 warps at ~160 registers: 3 blocks by registers, 4 by shared memory.
    assert plan.blocks_per_sm == 4
    assert feature_table([plan], H200)["resident"][0] == 3
    # Once the compiler has spoken, its figure is the plan's and the estimate is ignored.
    reported = plan.with_resources(ResourceUsage(registers=96), H200)
    assert feature_table([reported], H200)["resident"][0] == reported.blocks_per_sm == 4


def test_few_blocks_with_little_in_flight_are_latency_bound():
    # Little's law: a launch of few blocks, each with a shallow ring, cannot draw the
    # DRAM's bandwidth; deeper rings (more bytes in flight) shorten the memory side.
    problem = Problem(1, 128, batch=1, heads=32, kv_heads=8, kv_len=32768, dtype="bfloat16")
    params = CostParams(dram_latency_us=1.0, overlap=64.0)

    def plan(stages: int) -> KernelPlan:
        chosen = plan_kernel(
            problem,
            KernelParams("decode_f16", block_n=64, warps=4, stages=stages, m_tiles=1, splits=4),
            H200,
        )
        assert chosen.feasible, chosen.reason
        return chosen

    shallow, deep = predict(plan(2), H200, params), predict(plan(6), H200, params)
    assert shallow.dram_ms == pytest.approx(deep.dram_ms)  # the same bytes
    assert shallow.kernel_ms > 2 * shallow.dram_ms  # 32 blocks of 32 KiB in flight: latency bound
    assert deep.kernel_ms < shallow.kernel_ms
    no_latency = predict(plan(2), H200, CostParams(dram_latency_us=0.0, overlap=64.0))
    assert no_latency.kernel_ms < shallow.kernel_ms


def test_softmax_streams_hide_the_softmax_and_shared_operands_contend():
    """The wgmma terms: a consumer's softmax runs under another's GEMMs (and its own, with
    the overlap), never making a plan slower; with no hiding and no contention the model is
    the one before the terms (softmax and matmuls add up, shared memory only bounds)."""
    problem = Problem(4096, 64, batch=4, heads=16, dtype="bfloat16")
    plain = plan_kernel(problem, KernelParams("wgmma_f16", consumers=2), H200)
    overlapped = plan_kernel(problem, KernelParams("wgmma_f16", consumers=2, overlap=1), H200)
    assert plain.kernel_family.cost_terms(plain).softmax_streams == 2
    assert overlapped.kernel_family.cost_terms(overlapped).softmax_streams == 4
    assert predict(overlapped, H200).time_ms < predict(plain, H200).time_ms
    params = calibrated()
    assert 0 < params.softmax_hiding < 1 and params.shared_contention < 64
    off = dataclasses.replace(params, softmax_hiding=0.0, shared_contention=1e9)
    assert predict(overlapped, H200, off).time_ms == pytest.approx(
        predict(plain, H200, off).time_ms
    )
    # more hiding is never slower; more contention (a smaller p) never faster
    for plan in (plain, overlapped):
        times = [
            predict(plan, H200, dataclasses.replace(params, softmax_hiding=h)).time_ms
            for h in (0.0, 0.2, 0.5, 0.9)
        ]
        assert times == sorted(times, reverse=True)
        contended = [
            predict(plan, H200, dataclasses.replace(params, shared_contention=q)).time_ms
            for q in (1.0, 1.5, 4.0, 64.0)
        ]
        assert contended == sorted(contended, reverse=True)
    # a family of synchronous matmuls (one stream, operands through ldmatrix) is unchanged
    mma = plan_kernel(problem, KernelParams("mma_f16"), H200)
    assert predict(mma, H200).time_ms == predict(mma, H200, off).time_ms
