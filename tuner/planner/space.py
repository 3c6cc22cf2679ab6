"""The candidate space of a problem: every parameter combination, planned and judged.

Each registered family enumerates its own tunables' values (narrowed by the
search settings, ``SpaceAxes``). Parameters that give the same plan key (split
targets that lead to the same number of splits) give the same kernel and
launch, so only the first of each is kept: the space holds distinct plans.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tuner.device import DeviceProfile
from tuner.planner.families import family_named, family_names
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem


@dataclass(frozen=True, slots=True, init=False)
class SpaceAxes:
    """Which families to plan and, per tunable axis, the values it may take.

    ``families=None`` means every registered family. Axes are named by the
    families' ``Tunable.axis`` (``SpaceAxes(tile_sizes=(32,))``); an axis not
    given, or given with its family's own values, takes the family's values, so
    equal settings compare equal however they were spelled.
    """

    families: tuple[str, ...] | None
    overrides: tuple[tuple[str, tuple[int, ...]], ...]

    def __init__(
        self,
        families: Sequence[str] | None = None,
        values: Mapping[str, Sequence[int]] | None = None,
        **axes: Sequence[int],
    ) -> None:
        own = _axis_defaults()
        given = dict(values or {}) | axes
        unknown = sorted(set(given) - set(own))
        if unknown:
            raise ValueError(
                f"unknown tunable axes {', '.join(unknown)}; known: {', '.join(sorted(own))}"
            )
        overrides = tuple(
            sorted(
                (name, tuple(int(v) for v in value))
                for name, value in given.items()
                if tuple(value) != own[name]
            )
        )
        object.__setattr__(self, "families", None if families is None else tuple(families))
        object.__setattr__(self, "overrides", overrides)

    def family_names(self) -> tuple[str, ...]:
        return family_names() if self.families is None else self.families

    def values(self) -> dict[str, tuple[int, ...]]:
        """Every axis of the registered families with the values it takes."""
        return _axis_defaults() | dict(self.overrides)

    def __getattr__(self, name: str) -> tuple[int, ...]:
        values = object.__getattribute__(self, "values")()
        if name in values:
            return values[name]
        raise AttributeError(f"no tunable axis {name!r}")


def _axis_defaults() -> dict[str, tuple[int, ...]]:
    axes: dict[str, tuple[int, ...]] = {}
    for name in family_names():
        family = family_named(name)
        for tunable in family.tunables:
            axes[family.axis_name(tunable)] = tunable.values
    return axes


@dataclass(frozen=True, slots=True)
class CandidateSpace:
    feasible: tuple[KernelPlan, ...]
    rejected: tuple[KernelPlan, ...]

    def rejection_counts(self) -> Counter[str]:
        """How many candidates fell for each kind of reason (each number shown as N)."""
        return Counter(_reason_kind(plan.reason) for plan in self.rejected)


def _reason_kind(reason: str) -> str:
    """The reason with its numbers as N: ``shared memory N B exceeds ... limit N B``.

    Whole numbers only (``u32`` and ``float4s`` stay words), so the kind still reads.
    """
    return _NUMBER.sub("N", reason)


_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")


def enumerate_params(problem: Problem, axes: SpaceAxes | None = None) -> Iterable[KernelParams]:
    axes = axes or SpaceAxes()
    values = axes.values()
    for name in axes.family_names():
        family = family_named(name)
        # A family that cannot take the problem's dtype, direction or layout (a serving
        # batch or a dense problem) is no candidate at all: counting its every combination
        # as "rejected" would drown the reasons that matter (plan_kernel still refuses it in
        # one line if asked).
        if family.takes(problem) and family.takes_layout(problem):
            yield from family.enumerate_params(problem, values)


def candidate_space(
    problem: Problem, device: DeviceProfile, axes: SpaceAxes | None = None
) -> CandidateSpace:
    feasible: list[KernelPlan] = []
    rejected: list[KernelPlan] = []
    seen: set[str] = set()
    for params in enumerate_params(problem, axes):
        plan = plan_kernel(problem, params, device)
        key = plan.key()
        if key in seen:
            continue
        seen.add(key)
        (feasible if plan.feasible else rejected).append(plan)
    return CandidateSpace(tuple(feasible), tuple(rejected))
