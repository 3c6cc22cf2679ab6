"""Which plans the GPU fault tests break, and in which order the study meets them: named here.

The fault matrix used to take "the cost model's best one-split plans": a refit of the
model changed which plans got which fault (and the control became a 256-thread plan
whose fixture, declaring two parameters fewer than ``kernels/tiled.cu``, the driver
refused with "too many resources requested for launch"). Now every plan is named by
its key, and the study's trial order is this module's schedule, not the model's
ranking, so a cost-model change cannot move a fault. ``tests/test_reliability_faults.py``
compiles every broken source with the defines of the plans named here (no GPU needed),
and ``tests/test_gpu_faults.py`` runs them.

All plans are of the ``tiled`` family (the fixtures in ``tests/broken_kernels/`` stand
in for its source) on ``PROBLEM``; source faults need one sequence split.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fault_backend import LAUNCH_FAULTS

from tuner.planner.tunable import KernelPlan
from tuner.problem import Problem

PROBLEM = Problem(256, 64, batch=1, heads=2)

#: the single-fault test: fault -> the plan it is planted in. Thread counts from 64 to
#: 512 (512 is the tightest register budget for a fixture built with
#: ``__launch_bounds__(THREADS)``); the control is the plan the driver refused when the
#: fixture's parameters fell behind the real kernel's.
FAULT_PLANS: dict[str, str] = {
    "naive": "tiled/b128/r32/t256/s1",
    "illegal_address": "tiled/b64/r64/t128/s1",
    "hang": "tiled/b16/r16/t64/s1",
    "compile_error": "tiled/b32/r32/t128/s1",
    "wrong_answer": "tiled/b128/r128/t512/s1",
    "nan": "tiled/b64/r32/t256/s1",
    "too_many_threads": "tiled/b32/r64/t256/s1",
    "too_much_shared": "tiled/b64/r128/t512/s1",
}
#: measured before the first fault and after each: a two-split plan of the real kernel
GOOD_PLAN = "tiled/b32/r32/t128/s2"

#: the study's ten broken candidates: 2 RUNTIME_DEVICE, 1 TIMEOUT, 2 COMPILE,
#: 2 RESOURCES, 3 WRONG_ANSWER, in the order the study meets them
STUDY_FAULTS = (
    "illegal_address",
    "compile_error",
    "wrong_answer",
    "too_many_threads",
    "hang",
    "nan",
    "illegal_address",
    "too_much_shared",
    "wrong_answer",
    "compile_error",
)
STUDY_ONE_SPLIT = 30
STUDY_OTHERS = 30


def takes_source_faults(plan: KernelPlan) -> bool:
    return plan.family == "tiled" and plan.sequence_splits == 1


def by_key(plans: Iterable[KernelPlan], keys: Iterable[str]) -> list[KernelPlan]:
    """The plans of ``keys``, in that order; KeyError naming a key that is not among them."""
    found = {plan.key(): plan for plan in plans}
    missing = [key for key in keys if key not in found]
    if missing:
        raise KeyError(f"not among the usable plans: {', '.join(missing)}")
    return [found[key] for key in keys]


def study_schedule(plans: Iterable[KernelPlan]) -> list[KernelPlan]:
    """The study's 60 candidates in trial order: 30 one-split and 30 multi-split ``tiled``
    plans, each set by key, alternating (so a fault is followed by a plan of the other kind
    as often as not). Pure: the same ``plans`` give the same schedule on any machine."""
    tiled = sorted((p for p in plans if p.family == "tiled"), key=lambda p: p.key())
    one_split = [p for p in tiled if takes_source_faults(p)][:STUDY_ONE_SPLIT]
    others = [p for p in tiled if not takes_source_faults(p)][:STUDY_OTHERS]
    if len(one_split) < STUDY_ONE_SPLIT or len(others) < STUDY_OTHERS:
        raise ValueError(
            f"{len(one_split)} one-split and {len(others)} multi-split tiled plans; the study "
            f"needs {STUDY_ONE_SPLIT} and {STUDY_OTHERS}"
        )
    return [plan for pair in zip(one_split, others, strict=True) for plan in pair]


def place_faults(order: Sequence[KernelPlan], faults: Sequence[str]) -> dict[str, str]:
    """Spread ``faults`` over ``order`` (the trial order): never first or last, never two
    in a row (so each is followed by a good candidate), source faults on one-split plans.
    Returns plan key -> fault."""
    placed: dict[str, str] = {}
    taken: set[int] = set()
    position = 2
    for fault in faults:
        while True:
            if position >= len(order) - 1:
                raise ValueError("not enough room for the faults")
            plan = order[position]
            fits = fault in LAUNCH_FAULTS or takes_source_faults(plan)
            if fits and not {position - 1, position + 1} & taken:
                break
            position += 1
        placed[plan.key()] = fault
        taken.add(position)
        position += 3
    return placed
