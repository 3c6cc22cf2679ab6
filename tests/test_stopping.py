"""tuner.stopping: the rule's verdicts on synthetic posteriors (no study, no backend)."""

from __future__ import annotations

import math

import pytest

from tuner.device import H200
from tuner.model_sampler import NOISE, ResidualModel
from tuner.planner import SpaceAxes, candidate_space
from tuner.problem import Problem
from tuner.stopping import RULE, StoppingRule, judge

RULE_2_5 = StoppingRule(margin=0.02, probability=0.05, min_trials=1)


@pytest.fixture(scope="module")
def plans():
    space = candidate_space(Problem(1024, 64, dtype="float32"), H200, SpaceAxes())
    return sorted(space.feasible, key=lambda plan: plan.key())


def model_with(plans, predicted: list[float]) -> ResidualModel:
    return ResidualModel(plans[: len(predicted)], predicted)


def test_it_stops_when_every_other_plan_is_predicted_far_slower(plans):
    # The first plan measured as predicted; the rest predicted 3x slower than it.
    model = model_with(plans, [1.0] + [3.0] * 40)
    measured = {model.keys[0]: 1.0}
    verdict = judge(RULE_2_5, model, measured, model.keys[1:], counted=1)
    assert verdict.stop and verdict.waiting_for == ""
    assert verdict.best_key == model.keys[0] and verdict.best_ms == 1.0
    assert 0.0 <= verdict.chance < 0.05 and verdict.contender in model.keys[1:]


def test_an_unmeasured_near_tie_keeps_it_going_and_is_the_contender(plans):
    # One plan predicted 1% slower than the measured best: within the unexplained
    # spread (NOISE), so it may well be 2% faster.
    model = model_with(plans, [1.0, 1.01] + [3.0] * 40)
    verdict = judge(RULE_2_5, model, {model.keys[0]: 1.0}, model.keys[1:], counted=1)
    assert not verdict.stop and verdict.waiting_for == "contender"
    assert verdict.contender == model.keys[1]
    assert verdict.chance > 0.05
    # The chance is the posterior predictive's: below the 50% of an exact tie.
    assert verdict.chance < 0.5


def test_the_chance_is_the_predictive_normal_tail(plans):
    # Two plans only, the first measured: the second's chance follows the closed form.
    model = model_with(plans, [1.0, 1.2])
    measured = {model.keys[0]: 1.0}
    verdict = judge(RULE_2_5, model, measured, [model.keys[1]], counted=1)
    mean, spread = model.predictive(measured, [1])
    expected = 0.5 * math.erfc(-(math.log(1 / 1.02) - mean[0]) / spread[0] / math.sqrt(2))
    assert verdict.chance == pytest.approx(expected)
    assert spread[0] > NOISE  # the unshared features add their posterior spread


def test_a_family_measured_slower_than_predicted_hands_the_chance_to_another(plans):
    first = plans[0].family
    own = [plan for plan in plans if plan.family == first][:20]
    other = [plan for plan in plans if plan.family != first][:20]
    model = ResidualModel(own + other, [1.0] + [1.5] * 19 + [3.0] * 20)
    unmeasured = model.keys[1:]
    # Measured as predicted: nothing predicted 1.5x or 3x slower has a fair chance.
    assert judge(RULE_2_5, model, {model.keys[0]: 1.0}, unmeasured, counted=1).stop
    # Measured 4x slower than predicted: its own family is thought slower too, so the
    # other family's plans (3x, untouched by the correction) are the contenders.
    verdict = judge(RULE_2_5, model, {model.keys[0]: 4.0}, unmeasured, counted=1)
    assert not verdict.stop and verdict.chance > 0.5
    assert verdict.contender in {plan.key() for plan in other}


def test_not_before_the_floor(plans):
    model = model_with(plans, [1.0] + [3.0] * 40)
    rule = StoppingRule(margin=0.02, probability=0.05, min_trials=4)
    measured = {model.keys[0]: 1.0}
    for counted in (1, 2, 3):
        verdict = judge(rule, model, measured, model.keys[1:], counted=counted)
        assert not verdict.stop and verdict.waiting_for == "floor"
    assert judge(rule, model, measured, model.keys[1:], counted=4).stop


def test_nothing_is_judged_before_a_plan_has_a_time(plans):
    model = model_with(plans, [1.0] + [3.0] * 40)
    verdict = judge(RULE_2_5, model, {}, model.keys[1:], counted=5)  # five failures
    assert not verdict.stop and verdict.waiting_for == "no time yet"


def test_with_nothing_left_unmeasured_it_stops(plans):
    model = model_with(plans, [1.0, 1.0])
    measured = {model.keys[0]: 1.0, model.keys[1]: 1.0}
    verdict = judge(RULE_2_5, model, measured, [], counted=2)
    assert verdict.stop and verdict.chance == 0.0 and verdict.contender is None


def test_a_larger_margin_or_threshold_stops_sooner(plans):
    model = model_with(plans, [1.0, 1.01, 1.05, 1.1] + [3.0] * 40)
    measured = {model.keys[0]: 1.0}
    unmeasured = model.keys[1:]
    strict = judge(RULE_2_5, model, measured, unmeasured, counted=1)
    wide = StoppingRule(margin=0.5, probability=0.05, min_trials=1)
    lenient = StoppingRule(margin=0.02, probability=0.9, min_trials=1)
    assert not strict.stop
    assert judge(wide, model, measured, unmeasured, counted=1).stop
    assert judge(lenient, model, measured, unmeasured, counted=1).stop


def test_the_rule_describes_itself():
    rule = StoppingRule(margin=0.02, probability=0.05, min_trials=4)
    assert rule.describe() == (
        "no unmeasured plan has more than a 5% chance of beating the best by 2%"
    )
    assert rule.settings() == {
        "rule": RULE,
        "margin": 0.02,
        "probability": 0.05,
        "min_trials": 4,
    }
