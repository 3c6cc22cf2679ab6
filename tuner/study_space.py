"""The space the Optuna sampler sees, and how its points map to the planner's candidates.

Why this shape. The sampler proposes *parameters*, the planner judges *plans*:

* ``structured`` (TPE): a categorical ``family``, then one categorical per
  tunable of that family (named by ``KernelFamily.sampler_name``), each over
  the values that occur among the family's feasible candidates. TPE then
  learns which values of which tunable are fast, jointly (multivariate,
  grouped by family), which a single categorical over hundreds of plan names
  could not. A proposed point is planned and looked up by ``KernelPlan.key()``:
  several parameter points can give the same plan (an alias, which is fine); a
  point the planner or the compiler rejects comes back with their reason, so
  the search can end that trial without touching the backend.
* ``candidate`` (grid, random): one categorical ``candidate`` over the
  feasible plan keys, so ``GridSampler`` walks exactly the feasible plans, each
  once, instead of a Cartesian product that is mostly aliases and rejects, and
  random search draws uniformly from the plans.

Either way only plans in the feasible table ever reach a backend. No family
is named here: the families' tunables are read off the registry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import optuna

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.families import family_named
from tuner.planner.params import KernelParams
from tuner.planner.plan import KernelPlan
from tuner.planner.tunable import plan_kernel
from tuner.problem import Problem

Encoding = Literal["structured", "candidate"]


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a proposed point is: a feasible candidate, or why it is not one."""

    plan: KernelPlan | None
    reason: str = ""
    key: str = ""


class StudySpace:
    """The feasible candidates of one problem, as a sampler's search space."""

    def __init__(
        self,
        problem: Problem,
        device: DeviceProfile,
        feasible: Sequence[KernelPlan],
        rejected: Iterable[KernelPlan] = (),
        encoding: Encoding = "structured",
    ) -> None:
        if not feasible:
            raise ValueError("a study space needs at least one feasible candidate")
        self.problem = problem
        self.device = device
        self.encoding = encoding
        self.feasible = tuple(feasible)
        self.by_key = {plan.key(): plan for plan in self.feasible}
        self.rejected = {plan.key(): plan for plan in rejected}
        self.families = sorted({plan.family for plan in self.feasible})
        #: family -> (sampler parameter name, tunable name, values among its feasible plans)
        self.axes: dict[str, list[tuple[str, str, list[int]]]] = {}
        for name in self.families:
            family = family_named(name)
            plans = [plan.params for plan in self.feasible if plan.family == name]
            self.axes[name] = [
                (
                    family.sampler_name(tunable),
                    tunable.name,
                    sorted({getattr(params, tunable.name) for params in plans}),
                )
                for tunable in family.ordered_tunables()
            ]
        self.keys = sorted(self.by_key)

    # ------------------------------------------------------------------ sampler side

    def suggest(self, trial: optuna.Trial) -> KernelParams | str:
        """Ask ``trial`` for a point: its ``KernelParams`` (structured) or plan key (candidate)."""
        if self.encoding == "candidate":
            return str(trial.suggest_categorical("candidate", self.keys))
        family = str(trial.suggest_categorical("family", self.families))
        values = {
            tunable: int(trial.suggest_categorical(sampler_name, choices))
            for sampler_name, tunable, choices in self.axes[family]
        }
        return KernelParams(family, **values)

    def fixed_params(self, plan: KernelPlan) -> dict[str, Any]:
        """The sampler parameters that propose ``plan`` (for ``study.enqueue_trial``)."""
        if self.encoding == "candidate":
            return {"candidate": plan.key()}
        return {"family": plan.family} | {
            sampler_name: getattr(plan.params, tunable)
            for sampler_name, tunable, _ in self.axes[plan.family]
        }

    # ------------------------------------------------------------------ planner side

    def resolve(self, point: KernelParams | str) -> Resolved:
        """The feasible candidate a proposed point names, or the reason it names none."""
        if isinstance(point, str):
            plan = self.by_key.get(point)
            if plan is None:
                return Resolved(None, f"{point} is not a feasible candidate", key=point)
            return Resolved(plan, key=point)
        try:
            planned = plan_kernel(self.problem, point, self.device)
        except PlanError as error:
            return Resolved(None, str(error))
        key = planned.key()
        plan = self.by_key.get(key)
        if plan is not None:
            return Resolved(plan, key=key)
        if key in self.rejected:
            return Resolved(None, self.rejected[key].reason or "rejected", key=key)
        if not planned.feasible:
            return Resolved(None, planned.reason, key=key)
        return Resolved(None, f"{key} is outside the configured candidate space", key=key)
