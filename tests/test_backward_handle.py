"""The deploy path's backward handle without a GPU: its launch templates name every pointer by
role, and a call launches exactly the family's launches on the call's buffers, on the caller's
stream; the forward handle's LSE role is null unless a call asks for the log-sum-exps."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from test_attention_handle import Recording

from kernels import plan_choice
from kernels.backends import attention_handle
from kernels.backends.backward_handle import (
    BACKWARD_MARKERS,
    BACKWARD_ROLES,
    BackwardHandle,
    backward_marker_roles,
)
from kernels.launch import buffer_elements, launch_sequence
from tuner.device import H200
from tuner.planner.launches import BackwardBuffers, DeviceBuffers
from tuner.planner.tunable import KernelParams, plan_kernel
from tuner.problem import Problem

BACKWARD = Problem(300, 64, batch=2, heads=8, kv_heads=2, causal=True, dtype="bfloat16",
                   kv_len=400, direction="backward")  # fmt: skip


def backward_plan(**params: int) -> Any:
    tunables = {"block_m": 64, "block_n": 128, "warps": 8, "deterministic": 1, "group_split": 2}
    plan = plan_kernel(BACKWARD, KernelParams("mma_f16_bwd", **(tunables | params)), H200)
    assert plan.feasible, plan.reason
    return plan


def test_a_call_launches_the_familys_launches_on_its_buffers() -> None:
    plan = backward_plan()
    family = plan.kernel_family
    launches = launch_sequence(plan, BACKWARD_MARKERS)  # type: ignore[arg-type]
    functions = {launch.function: 100 + i for i, launch in enumerate(launches)}
    templates = attention_handle.launch_templates(
        launches, functions, markers=backward_marker_roles()
    )
    roles = {a for t in templates for a in t.arguments if isinstance(a, str)}
    assert roles == set(BACKWARD_ROLES) - {"sinks", "d_sinks"}  # no sinks: no sink launch
    driver = Recording()
    handle = BackwardHandle(
        BACKWARD, 0, plan_choice.ChosenPlan(plan, "default"), templates,
        family.backward_scratch(plan), driver, None,
    )  # fmt: skip
    addresses = {role: (1 << 36) + (i << 24) for i, role in enumerate(BACKWARD_ROLES)}
    handle.launch(addresses, stream=7)
    expected = launch_sequence(plan, BackwardBuffers(**addresses))  # type: ignore[arg-type]
    assert [launch.values() for launch, _ in driver.launched] == [e.args for e in expected]
    assert [stream for _, stream in driver.launched] == [7] * len(expected)
    assert [launch.function for launch, _ in driver.launched] == [
        functions[e.function] for e in expected
    ]


def test_unused_scratch_is_a_null_pointer() -> None:
    plan = backward_plan(deterministic=0, group_split=1)
    launches = launch_sequence(plan, BACKWARD_MARKERS)  # type: ignore[arg-type]
    functions = {launch.function: 1 for launch in launches}
    templates = attention_handle.launch_templates(
        launches, functions, markers=backward_marker_roles()
    )
    roles = {a for t in templates for a in t.arguments if isinstance(a, str)}
    assert "counters" not in roles and "dkv_partial" not in roles
    scratch = plan.kernel_family.backward_scratch(plan)
    assert scratch.counters == 0 and scratch.dkv_partial == 0


def test_the_forward_handles_lse_is_null_unless_asked_for() -> None:
    forward = dataclasses.replace(BACKWARD, direction="forward")
    plan = plan_kernel(forward, KernelParams("mma_f16", block_m=64, block_n=64), H200)
    launches = launch_sequence(plan, attention_handle.BUFFER_MARKERS)
    templates = attention_handle.launch_templates(launches, {"mma_f16_attention": 1})
    assert templates[0].arguments[-1] == "lse"
    driver = Recording()
    handle = attention_handle.AttentionHandle(
        forward, 0, plan_choice.ChosenPlan(plan, "default"), templates,
        buffer_elements(plan), driver, None,
    )  # fmt: skip
    slot = handle.slot(0, lambda nbytes: (None, 0))
    handle.launch(slot, 11, 12, 13, 14, lse=5000)
    handle.launch(slot, 11, 12, 13, 14)
    with_lse, without = (launch.values() for launch, _ in driver.launched)
    assert with_lse == launch_sequence(plan, DeviceBuffers(11, 12, 13, 14, lse=5000))[0].args
    assert without[-1] == np.uintp(0)
