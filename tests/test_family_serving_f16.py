"""The ``serving_f16`` family: serving problems only, planned on their seeded sample, with
launches that follow the kernel's signature, keys that merge planner settings deciding alike,
a cost model that sees the busiest CTA, and (where nvcc is installed) cubins without spills."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest

from kernels import build
from tuner.costmodel import predict_time_ms
from tuner.device import H200
from tuner.planner.families import family_named
from tuner.planner.launches import DeviceBuffers
from tuner.planner.params import KernelParams
from tuner.planner.space import candidate_space
from tuner.planner.tunable import plan_kernel
from tuner.planner.work_list import WorkLayout
from tuner.problem import Problem

FAMILY = family_named("serving_f16")
DECODE = Problem(
    1,
    128,
    batch=64,
    heads=32,
    kv_heads=8,
    kv_len=32768,
    dtype="bfloat16",
    page_size=16,
    lengths="skewed",
)
PREFILL = Problem(
    2048, 128, batch=8, heads=32, kv_heads=8, causal=True, dtype="bfloat16", lengths="uniform"
)
DENSE = Problem(1, 128, batch=16, heads=32, kv_heads=8, kv_len=8192, dtype="bfloat16")
DEFAULT = KernelParams("serving_f16")
PREFILL_PARAMS = KernelParams("serving_f16", warps=4, row_warps=4, block_n=64, stages=2)


def test_serving_and_dense_problems_go_to_their_own_families() -> None:
    assert not plan_kernel(DENSE, DEFAULT, H200).feasible
    assert "runs serving batches" in plan_kernel(DENSE, DEFAULT, H200).reason
    dense_params = KernelParams("decode_f16")
    refused = plan_kernel(DECODE, dense_params, H200)
    assert not refused.feasible
    assert refused.reason.startswith("page=16 lengths=skewed is a serving batch")
    space = candidate_space(DECODE, H200)
    assert space.feasible and {plan.family for plan in space.feasible} == {"serving_f16"}
    assert {plan.family for plan in space.rejected} == {"serving_f16"}
    assert "serving_f16" not in {plan.family for plan in candidate_space(DENSE, H200).rejected}


def test_a_plan_counts_the_keys_its_items_load() -> None:
    plan = plan_kernel(DECODE, DEFAULT, H200)
    assert plan.feasible, plan.reason
    work = FAMILY.work_list(plan, H200.sm_count)
    loaded = int((work.items[:, 4] - work.items[:, 3]).sum())
    # every request's keys once per KV head: the GQA group shares them
    assert loaded == DECODE.kv_rows_total * DECODE.kv_heads
    kv_bytes = 2 * 2 * loaded * 128
    partial = 4 * work.partial_rows * 129
    assert plan.global_read_bytes == DECODE.tensor_bytes + kv_bytes + partial
    assert plan.launch.grid == (H200.sm_count * DEFAULT.ctas_per_sm, 1, 1)
    assert (plan.reduce_launch is None) == (work.merge_count == 0)
    assert work.splits[0] > 1 and plan.reduce_launch is not None  # the 32768-key request


def test_launches_follow_the_kernel_signature() -> None:
    plan = plan_kernel(DECODE, DEFAULT, H200)
    buffers = DeviceBuffers(1, 2, 3, 4, 5, 6, work=7, pages=8)
    attention, merge = FAMILY.launches(plan, buffers)
    assert attention.function == "serving_f16_attention" and len(attention.args) == 21
    variant = [np.int32] * 3 + [np.float32] + [np.uintp] * 3
    assert [type(a) for a in attention.args] == [np.uintp] * 8 + [np.int32] * 5 + [
        np.float32
    ] + variant
    assert [int(a) for a in attention.args[:8]] == [1, 2, 3, 4, 5, 6, 7, 8]
    layout, words = FAMILY.tuning_buffer(plan)
    assert [int(a) for a in attention.args[8:13]] == [
        layout.requests_offset,
        layout.items_offset,
        layout.ctas_offset,
        8,
        16,
    ]
    assert merge.function == "serving_f16_split_merge" and len(merge.args) == 8
    assert int(merge.args[4]) == layout.merges_offset
    assert words[0] == FAMILY.work_list(plan, H200.sm_count).item_count
    np.testing.assert_array_equal(FAMILY.work_buffer(plan), words)
    with pytest.raises(ValueError, match="work buffer"):
        FAMILY.launches(plan, DeviceBuffers(1, 2, 3, 4))
    with pytest.raises(ValueError, match="pages"):
        FAMILY.launches(plan, DeviceBuffers(1, 2, 3, 4, work=5))


def test_defines_say_paged_or_ragged_and_the_tile() -> None:
    paged = FAMILY.compile_defines(plan_kernel(DECODE, DEFAULT, H200))
    assert paged["PAGED"] == 1 and paged["ROW_WARPS"] == 1 and paged["CTAS_PER_SM"] == 2
    ragged = FAMILY.compile_defines(plan_kernel(PREFILL, PREFILL_PARAMS, H200))
    assert ragged["PAGED"] == 0 and ragged["CAUSAL"] == 1 and ragged["ROW_WARPS"] == 4


def test_planner_settings_that_decide_alike_are_one_candidate() -> None:
    small = Problem(
        1, 128, batch=4, heads=32, kv_heads=8, kv_len=512, dtype="bfloat16", page_size=16
    )
    one = plan_kernel(small, KernelParams("serving_f16", max_splits=16), H200)
    other = plan_kernel(small, KernelParams("serving_f16", max_splits=128), H200)
    assert one.key() == other.key()  # 512 keys never reach 16 splits
    skewed_16 = plan_kernel(DECODE, KernelParams("serving_f16", max_splits=16), H200)
    skewed_128 = plan_kernel(DECODE, KernelParams("serving_f16", max_splits=128), H200)
    assert skewed_16.key() != skewed_128.key()
    assert skewed_16.sequence_splits <= 16


def test_items_larger_than_the_requests_are_rejected_with_a_reason() -> None:
    plan = plan_kernel(DECODE, KernelParams("serving_f16", warps=8, row_warps=8), H200)
    assert not plan.feasible and "more than needed" in plan.reason
    assert plan_kernel(PREFILL, PREFILL_PARAMS, H200).feasible


def test_the_cost_model_charges_the_busiest_cta() -> None:
    plan = plan_kernel(DECODE, DEFAULT, H200)
    terms = FAMILY.cost_terms(plan)
    assert terms.imbalance >= 1.0
    balanced = predict_time_ms(plan, H200)

    class Unbalanced(type(FAMILY)):
        def cost_terms(self, plan):
            return replace(super().cost_terms(plan), imbalance=terms.imbalance * 2)

    from tuner.planner import families

    families.unregister("serving_f16")
    try:
        families.register(Unbalanced())
        assert predict_time_ms(plan, H200) > balanced
    finally:
        families.unregister("serving_f16")
        families.register(FAMILY)


def test_the_tuning_buffer_is_sized_to_its_work_list() -> None:
    plan = plan_kernel(PREFILL, PREFILL_PARAMS, H200)
    layout, words = FAMILY.tuning_buffer(plan)
    work = FAMILY.work_list(plan, H200.sm_count)
    assert isinstance(layout, WorkLayout) and words.size == layout.words
    assert layout.capacity.items == work.item_count
    assert FAMILY.buffer_elements(plan).tensor == PREFILL.query_rows_total * 32 * 128


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize(
    ("problem", "params"),
    [(DECODE, DEFAULT), (PREFILL, PREFILL_PARAMS)],
    ids=["decode", "prefill"],
)
def test_the_default_plans_compile_without_spills(tmp_path, problem, params) -> None:
    plan = plan_kernel(problem, params, H200)
    compiled = build.compile_kernel(plan, tmp_path, arch="sm_90")
    assert isinstance(compiled, build.CompiledKernel), compiled
    for name, usage in compiled.resources.items():
        assert usage.spill_store_bytes == usage.spill_load_bytes == 0, (name, usage)
    judged = plan.with_resources(compiled.primary_resources, H200)
    assert judged.feasible, judged.reason
    assert judged.blocks_per_sm >= params.ctas_per_sm
