"""tuner.model_sampler: the model's ranking first, corrected by what was measured."""

from __future__ import annotations

import numpy as np
import optuna
import pytest

from tuner.costmodel import predict
from tuner.device import H200
from tuner.model_sampler import PARAMETER, ModelSampler, ResidualModel, plan_indicators
from tuner.planner import candidate_space
from tuner.problem import Problem
from tuner.study_space import StudySpace

PROBLEM = Problem(1024, 64, dtype="float32")


@pytest.fixture(scope="module")
def ranked():
    plans = candidate_space(PROBLEM, H200).feasible
    pairs = sorted(((p, predict(p, H200).time_ms) for p in plans), key=lambda x: x[1])
    return [p for p, _ in pairs], [ms for _, ms in pairs]


def test_indicators_name_the_family_its_values_and_the_split_count(ranked):
    plans, _ = ranked
    tiled = next(p for p in plans if p.family == "tiled")
    names = plan_indicators(tiled)
    assert names[0] == "family=tiled"
    assert f"tiled.tile_size={tiled.params.tile_size}" in names
    assert f"tiled.splits={tiled.sequence_splits}" in names
    assert not any("split_target" in name for name in names)  # an alias of the split count


def test_without_measurements_the_proposal_is_the_best_prediction(ranked):
    plans, predicted = ranked
    model = ResidualModel(plans, predicted)
    assert model.propose({}, set()) == plans[0].key()
    first_two = {plans[0].key(), plans[1].key()}
    assert model.propose({}, first_two) == plans[2].key()
    assert model.propose({}, {p.key() for p in plans}) is None


def test_a_family_measured_slower_than_predicted_moves_down(ranked):
    plans, predicted = ranked
    model = ResidualModel(plans, predicted)
    top = plans[0]
    other = next(p for p in plans if p.family != top.family)
    # The top plan's family runs 4x slower than predicted: after two of its plans,
    # the best plan of another family comes before the rest of it.
    same = [p for p in plans if p.family == top.family][:2]
    measured = {p.key(): 4.0 * predicted[plans.index(p)] for p in same}
    proposal = model.propose(measured, set(measured))
    ranked_other = min(
        (p for p in plans if p.family != top.family), key=lambda p: predicted[plans.index(p)]
    )
    assert proposal == ranked_other.key()
    assert other.family != top.family


def test_the_posterior_learns_a_tunable_value_that_is_slower_than_predicted(ranked):
    plans, predicted = ranked
    model = ResidualModel(plans, predicted)
    tiled = [p for p in plans if p.family == "tiled"]
    slow_value = tiled[0].params.tile_size
    measured = {
        p.key(): predicted[plans.index(p)] * (2.0 if p.params.tile_size == slow_value else 1.0)
        for p in tiled[:24]
    }
    mean, covariance = model.posterior(measured)
    column = model.features.index(f"tiled.tile_size={slow_value}")
    assert mean[column] > 0.3  # log 2 = 0.69, shrunk by the prior
    assert np.all(np.diag(covariance) > 0)
    # An unmeasured plan with that tile now ranks behind an equal one without it.
    corrected = model.corrected(mean)
    with_value = [
        i for i, p in enumerate(plans) if p.family == "tiled" and p.params.tile_size == slow_value
    ]
    assert all(corrected[i] > model.log_predicted[i] for i in with_value)


def test_after_a_time_the_proposal_is_the_plan_most_likely_to_beat_the_best(ranked):
    plans, predicted = ranked
    model = ResidualModel(plans, predicted)
    measured = {plans[0].key(): predicted[0] * 1.3}
    rows = model.open_rows(set(measured))
    chances = model.chances(measured, rows, margin=0.02)
    expected = chances.keys[int(np.argmax(chances.z))]
    assert model.propose(measured, set(measured), margin=0.02) == expected
    # Its chance is the largest, and a real probability.
    top = chances.keys.index(expected)
    assert chances.largest == chances.chance(top)
    assert 0.0 < chances.largest < 1.0
    assert all(chances.chance(i) <= chances.largest for i in range(len(chances.keys)))


def test_a_plan_predicted_far_slower_than_the_best_has_almost_no_chance(ranked):
    plans, predicted = ranked
    model = ResidualModel(plans, predicted)
    # Measured exactly as predicted: the regression stays at its prior.
    measured = {p.key(): predicted[i] for i, p in enumerate(plans[:12])}
    rows = model.open_rows(set(measured))
    chances = model.chances(measured, rows, margin=0.02)
    slowest = max(range(len(rows)), key=lambda j: model.log_predicted[rows[j]])
    assert predicted[rows[slowest]] > 3 * chances.best_ms
    assert chances.chance(slowest) < 1e-3
    # A larger margin asks for more: every chance shrinks.
    wider = model.chances(measured, rows, margin=0.2)
    assert np.all(wider.z < chances.z)


def test_proposals_are_deterministic(ranked):
    plans, predicted = ranked
    orders = []
    for _ in range(2):
        model = ResidualModel(plans, predicted)
        measured: dict[str, float] = {}
        for index in range(6):
            key = model.propose(measured, set(measured))
            assert key is not None and key not in measured
            measured[key] = predicted[index] * 1.1
        orders.append(list(measured))
    assert orders[0] == orders[1]


def test_in_a_study_it_proposes_each_plan_once_and_only_allowed_plans(ranked):
    plans, predicted = ranked
    allowed = plans[: len(plans) // 2]
    space = StudySpace(PROBLEM, H200, plans, encoding="candidate")
    sampler = ModelSampler(allowed, predicted[: len(allowed)], seed=1)
    study = optuna.create_study(sampler=sampler)
    seen = []

    def objective(trial: optuna.Trial) -> float:
        key = space.suggest(trial)
        seen.append(key)
        return predicted[plans.index(space.by_key[key])] * (1.5 if "t64" in key else 1.0)

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study.optimize(objective, n_trials=min(30, len(allowed)))
    assert len(seen) == len(set(seen))
    assert set(seen) <= {p.key() for p in allowed}
    assert seen[0] == allowed[0].key()
    assert trial_param(study) == PARAMETER


def trial_param(study: optuna.Study) -> str:
    (name,) = study.trials[0].params
    return name
