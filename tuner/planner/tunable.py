"""The tunable planner: a plan that describes the CUDA kernel actually launched.

``plan_kernel(problem, params, device)`` validates the problem, asks the
params' family (``tuner.planner.families``) for the plan, and rules out a
family that does not take the problem's dtype. The families own everything
else; the names below are re-exported for the modules and tests that import
them from here.
"""

from __future__ import annotations

from dataclasses import replace

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.families import family_named, family_names
from tuner.planner.families.base import checked_u32
from tuner.planner.families.scalar_online import SMALLEST_SCALAR_THREADS, scalar_shared_bytes
from tuner.planner.families.tiled import (
    REDUCE_THREADS,
    SHARED_ROW_PAD,
    SMALLEST_TILE,
    TILED_NON_MATMUL_FLOPS_PER_PAIR,
    TILED_NON_MATMUL_FLOPS_PER_ROW_TILE,
    choose_threads_per_row,
    tiled_shared_bytes,
)
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan, Launch, ResourceUsage
from tuner.problem import SUPPORTED_DTYPES, Problem

#: float32 bytes: split scratch is float32 whatever the problem's dtype
F32_BYTES = 4

__all__ = [
    "F32_BYTES",
    "REDUCE_THREADS",
    "SHARED_ROW_PAD",
    "SMALLEST_SCALAR_THREADS",
    "SMALLEST_TILE",
    "TILED_NON_MATMUL_FLOPS_PER_PAIR",
    "TILED_NON_MATMUL_FLOPS_PER_ROW_TILE",
    "KernelParams",
    "KernelPlan",
    "Launch",
    "ResourceUsage",
    "choose_threads_per_row",
    "family_names",
    "plan_kernel",
    "scalar_shared_bytes",
    "tiled_shared_bytes",
    "validate_problem",
]


def plan_kernel(problem: Problem, params: KernelParams, device: DeviceProfile) -> KernelPlan:
    """Plan one candidate. Infeasible candidates come back with ``feasible=False``
    and a one-line ``reason``; ``PlanError`` is raised only for a problem that no
    candidate could serve (empty or overflowing dimensions, unknown dtype) or an
    unknown family.
    """
    validate_problem(problem)
    family = family_named(params.family)
    plan = family.plan(problem, params, device)
    if problem.dtype not in family.dtypes:
        reason = (
            f"{family.name} kernels take {', '.join(family.dtypes)}, not {problem.dtype}"
        )
        return replace(plan, feasible=False, reason=reason)
    if reason := family.direction_verdict(problem):
        return replace(plan, feasible=False, reason=reason)
    return plan


def validate_problem(problem: Problem) -> None:
    for name in ("seq_len", "head_dim", "batch", "heads"):
        value = getattr(problem, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{name}={value!r} is invalid: must be an integer")
        if value <= 0:
            raise PlanError(f"{name}={value} is invalid: must be > 0")
        checked_u32(value, name)
    if problem.dtype not in SUPPORTED_DTYPES:
        raise PlanError(
            f"dtype={problem.dtype!r} is not supported; allowed: {', '.join(SUPPORTED_DTYPES)}"
        )
    checked_u32(
        problem.batch * problem.heads * problem.seq_len * problem.head_dim,
        f"batch*heads*seq_len*head_dim ({problem.label()}) elements",
    )
