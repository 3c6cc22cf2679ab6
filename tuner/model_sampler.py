"""The ``model`` sampler: the cost model's ranking, corrected by what the study has measured.

The correction is ``log(predicted) + x . w``, where ``x`` are indicator
features of the plan (its family, and each of its tunables' values within the
family, and its split count) and ``w`` is the posterior of a Bayesian linear
regression of the measured residuals ``log(measured / predicted)`` on those
features. The prior says the model is right (``w = 0``) with a spread per
family (``FAMILY_PRIOR``: families differ most, e.g. a decode kernel against a
prefill kernel at a decode shape) and a smaller one per tunable value
(``VALUE_PRIOR``); ``NOISE`` is what no feature explains. A plan measured
slower than predicted moves the plans that share its values down the ranking,
and one measured faster moves them up.

Each unmeasured plan's log time then has a posterior predictive normal
distribution (mean ``log(predicted) + x . mean``, variance ``x Cov x' +
NOISE^2``), and so a *chance* of beating the best measured time by a margin
(``ResidualModel.chances``). Before anything is timed the sampler proposes the
best prediction; after, the plan with the highest chance of beating the best by
``margin`` (probability of improvement): a near-tie the data cannot tell apart
and a direction no measurement has tried (its prior spread) both keep a chance,
and the plan most likely to pay off goes first. The same chances are what the
stopping rule reads (``tuner.stopping``): the search measures the plan the rule
is most worried about, and stops when no plan is worth a worry. Proposals are
deterministic: the data decide, not a seed. Parallel workers see each other's
running trials and never propose them.

It works on the ``candidate`` encoding (``tuner.study_space``): the proposals
are plan keys of the feasible table within the traffic cutoff, so a plan the
planner or the compiler rejected is never proposed. Pure numpy besides the
Optuna sampler interface; no GPU or database code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from tuner.planner.families import family_named
from tuner.planner.plan import KernelPlan

#: prior standard deviation (log time) of a family's correction
FAMILY_PRIOR = 0.3
#: prior standard deviation of one tunable value's correction (within its family)
VALUE_PRIOR = 0.1
#: standard deviation of a measurement's residual that no feature explains
NOISE = 0.05
#: the improvement the proposals aim at, as a fraction of the best time (the stopping
#: rule's margin, ``search.stop_margin``)
MARGIN = 0.02
#: the sampler parameter it answers (``StudySpace`` candidate encoding)
PARAMETER = "candidate"


def plan_indicators(plan: KernelPlan) -> list[str]:
    """The features a plan has: its family, and (family, tunable, value) for each tunable."""
    family = family_named(plan.family)
    names = [f"family={plan.family}"]
    names += [
        f"{plan.family}.{tunable.name}={getattr(plan.params, tunable.name)}"
        for tunable in family.ordered_tunables()
        if tunable.name != "split_target"  # an alias of the split count below
    ]
    names.append(f"{plan.family}.splits={plan.sequence_splits}")
    return names


class ResidualModel:
    """Bayesian linear regression of log(measured / predicted) on plan indicators."""

    def __init__(self, plans: Sequence[KernelPlan], predicted_ms: Sequence[float]) -> None:
        self.keys = [plan.key() for plan in plans]
        self.index = {key: i for i, key in enumerate(self.keys)}
        rows = [plan_indicators(plan) for plan in plans]
        self.features = sorted({name for row in rows for name in row})
        column = {name: j for j, name in enumerate(self.features)}
        self.x = np.zeros((len(plans), len(self.features)))
        for i, row in enumerate(rows):
            self.x[i, [column[name] for name in row]] = 1.0
        prior = [
            FAMILY_PRIOR if name.startswith("family=") else VALUE_PRIOR for name in self.features
        ]
        self.prior_precision = np.diag(1.0 / np.square(prior))
        self.log_predicted = np.log(np.asarray(predicted_ms, dtype=float))

    def posterior(self, measured: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
        """(mean, covariance) of the corrections given measured medians by plan key."""
        rows = [self.index[key] for key in measured if key in self.index]
        if not rows:
            return np.zeros(len(self.features)), np.linalg.inv(self.prior_precision)
        x = self.x[rows]
        y = np.log([measured[self.keys[i]] for i in rows]) - self.log_predicted[rows]
        precision = self.prior_precision + x.T @ x / NOISE**2
        covariance = np.linalg.inv(precision)
        return covariance @ (x.T @ y) / NOISE**2, covariance

    def corrected(self, weights: np.ndarray) -> np.ndarray:
        """Corrected log predicted time of every plan under correction ``weights``."""
        return self.log_predicted + self.x @ weights

    def predictive(
        self, measured: Mapping[str, float], rows: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(mean, standard deviation) of the log time of plans ``rows`` given ``measured``."""
        mean, covariance = self.posterior(measured)
        x = self.x[list(rows)]
        spread = np.einsum("ij,jk,ik->i", x, covariance, x) + NOISE**2
        return self.log_predicted[list(rows)] + x @ mean, np.sqrt(spread)

    def chances(
        self, measured: Mapping[str, float], rows: Sequence[int], margin: float
    ) -> Chances:
        """How likely each plan of ``rows`` is to beat the best of ``measured`` by ``margin``.

        ``measured`` must hold a time: the chances are relative to its best.
        """
        mean, spread = self.predictive(measured, rows)
        best_key = min(measured, key=lambda key: (measured[key], key))
        target = math.log(measured[best_key] / (1.0 + margin))
        return Chances(
            keys=[self.keys[i] for i in rows],
            z=(target - mean) / spread,
            best_key=best_key,
            best_ms=measured[best_key],
            margin=margin,
        )

    def open_rows(self, excluded: set[str]) -> list[int]:
        return [i for i, key in enumerate(self.keys) if key not in excluded]

    def propose(
        self, measured: Mapping[str, float], excluded: set[str], margin: float = MARGIN
    ) -> str | None:
        """The key to measure next: the best prediction while nothing is timed, then the
        plan with the highest chance of beating the best by ``margin``; None if all are
        excluded."""
        rows = self.open_rows(excluded)
        if not rows:
            return None
        if not measured:
            mean, _ = self.posterior(measured)
            return self.keys[rows[int(np.argmin(self.corrected(mean)[rows]))]]
        return self.chances(measured, rows, margin).contender


@dataclass(frozen=True)
class Chances:
    """Per plan, the chance of beating ``best_ms`` by ``margin`` (as a normal z-score)."""

    keys: list[str]
    #: (log(best / (1 + margin)) - predictive mean) / predictive standard deviation
    z: np.ndarray
    best_key: str
    best_ms: float
    margin: float

    def chance(self, index: int) -> float:
        return normal_cdf(float(self.z[index]))

    @property
    def top(self) -> int | None:
        """Index of the plan with the highest chance (the first of equals); None if none."""
        return int(np.argmax(self.z)) if len(self.keys) else None

    @property
    def contender(self) -> str | None:
        top = self.top
        return None if top is None else self.keys[top]

    @property
    def largest(self) -> float:
        """The highest chance (0 with no plan left)."""
        top = self.top
        return 0.0 if top is None else self.chance(top)


def normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


class ModelSampler(optuna.samplers.BaseSampler):
    """Optuna sampler over plan keys, steered by the cost model and the study's measurements.

    ``plans``: the candidates it may propose (feasible, within the traffic
    cutoff), ``predicted_ms`` their predictions, ``margin`` the improvement its
    proposals aim at. ``seed`` seeds only the fallback: any other parameter (none
    in the candidate encoding) is sampled at random.
    """

    def __init__(
        self,
        plans: Sequence[KernelPlan],
        predicted_ms: Sequence[float],
        seed: int = 0,
        margin: float = MARGIN,
    ) -> None:
        self.model = ResidualModel(plans, predicted_ms)
        self.margin = margin
        self._fallback = optuna.samplers.RandomSampler(seed=seed)

    def reseed_rng(self) -> None:
        self._fallback.reseed_rng()

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return {}

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        if param_name != PARAMETER:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        measured, excluded = study_evidence(study.get_trials(deepcopy=False))
        key = self.model.propose(measured, excluded, self.margin)
        if key is None:  # everything evaluated: the search stops on its own; any key will do
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        return key


def study_evidence(trials: Sequence[FrozenTrial]) -> tuple[dict[str, float], set[str]]:
    """(measured median by key, keys evaluated or in flight) from a study's trials."""
    measured: dict[str, float] = {}
    excluded: set[str] = set()
    for trial in trials:
        fixed = trial.system_attrs.get("fixed_params") or {}
        key = (
            trial.params.get(PARAMETER) or fixed.get(PARAMETER) or trial.user_attrs.get("plan_key")
        )
        if not isinstance(key, str):
            continue
        if trial.state == TrialState.COMPLETE and trial.value is not None:
            if math.isfinite(trial.value) and trial.value > 0:
                measured[key] = float(trial.value)
            excluded.add(key)
        elif trial.state in (TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING):
            excluded.add(key)
    return measured, excluded
