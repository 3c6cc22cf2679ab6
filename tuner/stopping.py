"""When the search has measured enough: the stopping rule over the model sampler's posterior.

After each trial that counts, every unmeasured plan within the traffic cutoff
has a chance of beating the best measured time by more than ``margin``: the
posterior predictive of its log time under the model sampler's regression of
the measured residuals (``tuner.model_sampler.ResidualModel.chances``)::

    chance(plan) = Phi((log(best / (1 + margin)) - mu(plan)) / sd(plan))
    mu = log(predicted) + x . mean,   sd^2 = x Cov x' + NOISE^2

The search stops when no unmeasured plan has a chance of at least
``probability``, once ``min_trials`` trials count (the floor); ``n_trials``
stays the cap. The model sampler proposes the plan with the highest chance
next, so a search that goes on measures the very plan that keeps it going.
A plan failed by the backend counts towards the floor and the cap and is no
longer unmeasured; nothing is judged before a plan has a time.

Pure: numpy and the regression's state; the study's bookkeeping (recording
the verdict, resuming, several workers) is ``tuner.search``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tuner.model_sampler import ResidualModel

#: the rule, in the words a study records and a run prints
RULE = "model posterior: P(unmeasured plan < best / (1 + margin)) < probability"


@dataclass(frozen=True, slots=True)
class StoppingRule:
    """``search.stop_margin``, ``search.stop_probability`` and ``search.min_trials``."""

    margin: float
    probability: float
    min_trials: int

    def describe(self) -> str:
        return (
            f"no unmeasured plan has more than a {_percent(self.probability)} chance of "
            f"beating the best by {_percent(self.margin)}"
        )

    def settings(self) -> dict[str, Any]:
        """What a study records of the rule (and compares when it is resumed)."""
        return {
            "rule": RULE,
            "margin": self.margin,
            "probability": self.probability,
            "min_trials": self.min_trials,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """The rule's answer after ``counted`` trials."""

    stop: bool
    counted: int
    #: the highest chance of an unmeasured plan (0 where none is left)
    chance: float = 0.0
    #: the plan with that chance
    contender: str | None = None
    best_key: str | None = None
    best_ms: float | None = None
    #: why it does not stop yet: "floor", "no time yet" or "contender"; "" when it stops
    waiting_for: str = ""


def judge(
    rule: StoppingRule,
    model: ResidualModel,
    measured: Mapping[str, float],
    unmeasured: Iterable[str],
    counted: int,
) -> Verdict:
    """Whether to stop after ``counted`` trials, given the measured medians by plan key
    and the keys of the plans not evaluated yet (the ones the model knows are judged)."""
    if counted < rule.min_trials:
        return Verdict(False, counted, waiting_for="floor")
    if not measured:
        return Verdict(False, counted, waiting_for="no time yet")
    rows = [model.index[key] for key in unmeasured if key in model.index]
    chances = model.chances(measured, rows, rule.margin)
    largest = chances.largest
    return Verdict(
        stop=largest < rule.probability,
        counted=counted,
        chance=largest,
        contender=chances.contender,
        best_key=chances.best_key,
        best_ms=chances.best_ms,
        waiting_for="" if largest < rule.probability else "contender",
    )


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"
