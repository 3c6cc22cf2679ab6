"""Which of a model's problems can be served: the planner decides, problem by problem.

A problem the planner cannot plan (``PlanError``: a tensor past the kernels' 32-bit
indexing), or whose every candidate it rejects (a family that refuses a variant, a
head_dim no family takes), is skipped with the planner's reason, never dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tuner.device import DeviceProfile
from tuner.llm.problems import ModelProblem
from tuner.planner.errors import PlanError
from tuner.planner.space import CandidateSpace, SpaceAxes, candidate_space
from tuner.problem import Problem


@dataclass(frozen=True, slots=True)
class SkippedProblem:
    """A problem of the model this run cannot tune, and why (one line)."""

    model_problem: ModelProblem
    reason: str


def sort_by_planner(
    problems: Iterable[ModelProblem], device: DeviceProfile, axes: SpaceAxes
) -> tuple[dict[Problem, CandidateSpace], tuple[SkippedProblem, ...]]:
    """The candidate spaces of the problems the planner can serve (in order), and the
    problems it cannot, each with the planner's reason."""
    spaces: dict[Problem, CandidateSpace] = {}
    skipped: list[SkippedProblem] = []
    for model_problem in problems:
        try:
            space = candidate_space(model_problem.problem, device, axes)
        except PlanError as error:
            skipped.append(SkippedProblem(model_problem, f"cannot be planned: {error}"))
            continue
        if space.feasible:
            spaces[model_problem.problem] = space
            continue
        first = space.rejected[0].reason if space.rejected else "no family takes it"
        reason = (
            f"no feasible candidate on {device.name} (all {len(space.rejected)} rejected; "
            f"first: {first})"
        )
        skipped.append(SkippedProblem(model_problem, reason))
    return spaces, tuple(skipped)
