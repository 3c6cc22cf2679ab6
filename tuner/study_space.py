"""The space the Optuna sampler sees, and how its points map to the planner's candidates.

Why this shape. The sampler proposes *parameters*, the planner judges *plans*:

* ``structured`` (TPE): one categorical per tunable (``family``, then
  ``scalar_threads`` for ``scalar_online``, or ``tile_size``,
  ``rows_per_block``, ``threads`` and ``split_target`` for ``tiled``), each over
  the values that occur among the feasible candidates. TPE then learns which
  values of which tunable are fast, jointly (multivariate, grouped by
  family), which a single categorical over hundreds of plan names could not.
  A proposed point is planned and looked up by ``KernelPlan.key()``: several
  split targets can give the same plan (an alias, which is fine); a point the
  planner or the compiler rejects comes back with their reason, so the search
  can end that trial without touching the backend.
* ``candidate`` (grid, random): one categorical ``candidate`` over the
  feasible plan keys, so ``GridSampler`` walks exactly the feasible plans, each
  once, instead of a Cartesian product that is mostly aliases and rejects, and
  random search draws uniformly from the plans.

Either way only plans in the feasible table ever reach a backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import optuna

from tuner.device import DeviceProfile
from tuner.planner.errors import PlanError
from tuner.planner.tunable import KernelParams, KernelPlan, plan_kernel
from tuner.problem import Problem

Encoding = Literal["structured", "candidate"]
_TILED_AXES = ("tile_size", "rows_per_block", "threads", "split_target")


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
        self.scalar_threads = sorted(
            {p.threads for p in self.feasible if p.family == "scalar_online"}
        )
        tiled = [p.params for p in self.feasible if p.family == "tiled"]
        self.tiled_values = {
            axis: sorted({getattr(params, axis) for params in tiled}) for axis in _TILED_AXES
        }
        self.keys = sorted(self.by_key)

    # ------------------------------------------------------------------ sampler side

    def suggest(self, trial: optuna.Trial) -> KernelParams | str:
        """Ask ``trial`` for a point: its ``KernelParams`` (structured) or plan key (candidate)."""
        if self.encoding == "candidate":
            return str(trial.suggest_categorical("candidate", self.keys))
        family = trial.suggest_categorical("family", self.families)
        if family == "scalar_online":
            threads = trial.suggest_categorical("scalar_threads", self.scalar_threads)
            return KernelParams("scalar_online", threads=int(threads))
        values = {
            axis: int(trial.suggest_categorical(axis, self.tiled_values[axis]))
            for axis in _TILED_AXES
        }
        return KernelParams("tiled", **values)

    def fixed_params(self, plan: KernelPlan) -> dict[str, Any]:
        """The sampler parameters that propose ``plan`` (for ``study.enqueue_trial``)."""
        if self.encoding == "candidate":
            return {"candidate": plan.key()}
        if plan.family == "scalar_online":
            return {"family": "scalar_online", "scalar_threads": plan.threads}
        return {"family": "tiled"} | {axis: getattr(plan.params, axis) for axis in _TILED_AXES}

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
