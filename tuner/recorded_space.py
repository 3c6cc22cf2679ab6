"""The space a recording was made in: a replay searches it, not the planner's space of today.

A recording times every feasible plan of its families (``bench/record_replay.py``). A
tunable added to a family since (the Hopper ping-pong, the staged epilogue) makes plans
the recording cannot hold: its plans ran that tunable at the value it had before it
existed (``Tunable.stored_before``, else its default), and its other values are not in it.
Such plans are ruled out of a replay with this reason, as plans of a family the recording
did not time are, rather than tried and failed one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuner.planner.plan import KernelPlan

if TYPE_CHECKING:
    from kernels.backends.replay import Recording


def recorded_tunables(recording: Recording) -> set[str]:
    """The tunable names a recording's entries carry (what it was recorded with)."""
    return {
        name for entry in recording.entries.values() for name in entry.params if name != "family"
    }


def unrecorded_reason(plan: KernelPlan, known: set[str]) -> str:
    """Why ``plan`` lies outside a recording that knows the tunables ``known`` ("" when
    it lies inside: every tunable it lacks is at the value its plans ran with)."""
    for tunable in plan.kernel_family.tunables:
        if tunable.name in known:
            continue
        ran = tunable.default if tunable.stored_before is None else tunable.stored_before
        value = plan.params.tunables[tunable.name]
        if value != ran:
            return (
                f"{plan.family} {tunable.name}={value} is not in the recording "
                f"(recorded before {tunable.name} existed: its plans ran {tunable.name}={ran})"
            )
    return ""
