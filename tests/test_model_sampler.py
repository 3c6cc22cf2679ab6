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


def test_without_measurements_the_greedy_proposal_is_the_best_prediction(ranked):
    plans, predicted = ranked
    model = ResidualModel(plans, predicted)
    rng = np.random.default_rng(0)
    assert model.propose({}, set(), rng, temperature=0.0) == plans[0].key()
    first_two = {plans[0].key(), plans[1].key()}
    assert model.propose({}, first_two, rng, temperature=0.0) == plans[2].key()
    assert model.propose({}, {p.key() for p in plans}, rng, temperature=0.0) is None


def test_a_family_measured_slower_than_predicted_moves_down(ranked):
    plans, predicted = ranked
    model = ResidualModel(plans, predicted)
    top = plans[0]
    other = next(p for p in plans if p.family != top.family)
    # The top plan's family runs 4x slower than predicted: after two of its plans,
    # the best plan of another family comes before the rest of it.
    same = [p for p in plans if p.family == top.family][:2]
    measured = {p.key(): 4.0 * predicted[plans.index(p)] for p in same}
    proposal = model.propose(measured, set(measured), np.random.default_rng(0), temperature=0.0)
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


def test_seeds_change_the_order_but_not_the_first_pick(ranked):
    plans, predicted = ranked
    orders = []
    for seed in range(4):
        model = ResidualModel(plans, predicted)
        rng = np.random.default_rng(seed)
        excluded: set[str] = set()
        order = []
        for _ in range(6):
            key = model.propose({}, excluded, rng, temperature=0.5)
            assert key is not None and key not in excluded
            excluded.add(key)
            order.append(key)
        orders.append(order)
    assert len({tuple(order) for order in orders}) > 1


def test_in_a_study_it_proposes_each_plan_once_and_only_allowed_plans(ranked):
    plans, predicted = ranked
    allowed = plans[: len(plans) // 2]
    space = StudySpace(PROBLEM, H200, plans, encoding="candidate")
    sampler = ModelSampler(allowed, predicted[: len(allowed)], seed=1, temperature=0.0)
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
