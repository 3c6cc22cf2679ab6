"""Compile the candidate space before the search, and re-judge each plan by ptxas's report.

Compiling every variant up front (``kernels.build.compile_many``, one nvcc per
CPU) is much faster than compiling inside each trial, and it lets the compiler
rule plans out before any GPU time is spent: a variant nvcc rejects, or whose
registers spill or exceed the register file (``KernelPlan.with_resources``),
joins the rejected plans with the reason, so the search never measures it.
Runs in the parent process: nvcc needs no GPU, and no CUDA context is made.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from tqdm import tqdm

from tuner.device import DeviceProfile
from tuner.planner.tunable import KernelPlan


def precompile(
    plans: Sequence[KernelPlan],
    device: DeviceProfile,
    cache_dir: str,
    jobs: int = 0,
) -> tuple[list[KernelPlan], list[KernelPlan]]:
    """(plans the compiler accepts, re-judged with their resources; plans it rules out).

    Raises ``BackendError`` only when a variant is not cached and there is no nvcc.
    """
    from kernels import build

    with tqdm(
        total=len({build.KernelSpec.from_plan(p).key for p in plans}),
        desc="compiling",
        unit="kernel",
        file=sys.stderr,
        disable=None,  # no bar where stderr is not a terminal
    ) as bar:
        results = build.compile_many(
            plans,
            cache_dir,
            jobs=jobs or None,
            arch=device.arch,
            progress=lambda done, total, result: bar.update(1),
        )
    accepted: list[KernelPlan] = []
    rejected: list[KernelPlan] = []
    for plan in plans:
        result = results[build.KernelSpec.from_plan(plan).key]
        if isinstance(result, build.CompileFailure):
            reason = f"nvcc rejects it: {result.reason}"
            rejected.append(dataclasses.replace(plan, feasible=False, reason=reason))
            continue
        judged = plan.with_resources(result.primary_resources, device)
        (accepted if judged.feasible else rejected).append(judged)
    return accepted, rejected
