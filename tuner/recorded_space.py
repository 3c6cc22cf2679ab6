"""The space a recording was made in: a replay searches it, not the planner's space of today.

A recording times every feasible plan of its families (``bench/record_replay.py``). A
tunable added to a family since (the Hopper ping-pong, the staged epilogue) makes plans
the recording cannot hold: its plans ran that tunable at the value it had before it
existed (``Tunable.stored_before``, else its default), and its other values are not in it.
Such plans are ruled out of a replay with this reason, as plans of a family the recording
did not time are, rather than tried and failed one by one.
"""

from __future__ import annotations

import dataclasses
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


def choice_added_since(plan: KernelPlan, recording: Recording) -> str:
    """A tunable value of ``plan`` that no recorded plan of its family ran, as
    ``name=value`` ("" when every value was ran): a choice added to the planner since the
    recording (a new key tile). Only meaningful for a plan whose key the recording lacks:
    a tunable that does not enter the key (a split target) is recorded at one of the
    values that make that key."""
    ran: dict[str, set[object]] = {}
    for entry in recording.entries.values():
        if entry.params.get("family") == plan.family:
            for name, value in entry.params.items():
                ran.setdefault(name, set()).add(value)
    for name, value in plan.params.tunables.items():
        if name in ran and value not in ran[name]:
            return f"{name}={value}"
    return ""


def within_recording(
    plans: list[KernelPlan], recording: Recording
) -> tuple[list[KernelPlan], list[KernelPlan]]:
    """``plans`` split into those a replay of ``recording`` can answer and the rest, ruled
    out with their reason: a family it did not time (its ``source_hashes`` name those it
    did), a tunable added since at a value its plans never ran, what its compiler ruled
    out, and a key it lacks (the recorder times every feasible plan, so a missing key, such
    as a key tile added since, lies outside the recorded space)."""
    recorded = set(recording.source_hashes)
    known = recorded_tunables(recording)

    def verdict(plan: KernelPlan) -> str:
        if recorded and plan.family not in recorded:
            return f"{plan.family} is not in the recording"
        if reason := unrecorded_reason(plan, known) or recording.rejection(plan.key()):
            return reason
        if plan.key() not in recording.entries:
            added = choice_added_since(plan, recording)
            why = f"{added} was added since" if added else "outside the space it was recorded in"
            return f"{plan.key()} is not in the recording ({len(recording.entries)} plans): {why}"
        return ""

    inside, outside = [], []
    for plan in plans:
        if reason := verdict(plan):
            outside.append(dataclasses.replace(plan, feasible=False, reason=reason))
        else:
            inside.append(plan)
    return inside, outside
