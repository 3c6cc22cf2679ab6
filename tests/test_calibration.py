"""tuner.calibration: the fit recovers constants it generated data from, and scores honestly."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tuner import costmodel
from tuner.calibration import (
    BOUNDS,
    START,
    Grid,
    fit,
    fitted_constants,
    leave_one_out,
    loss,
    nelder_mead,
    score,
    weights,
)
from tuner.costmodel import CostParams, model_times
from tuner.device import H200
from tuner.planner import candidate_space
from tuner.planner.space import SpaceAxes
from tuner.problem import Problem

PROBLEMS = [
    Problem(1024, 64, batch=2, heads=4),
    Problem(2048, 128),
    Problem(512, 64, batch=4, heads=8, causal=True),
]
#: constants the synthetic grids are generated from: away from START in every fitted one
TRUTH = dataclasses.replace(
    START,
    dram_efficiency=0.8,
    l2_over_dram=3.0,
    ffma_efficiency=0.55,
    latency_cycles=96.0,
    max_ilp=16.0,
)


def synthetic_grid(problem: Problem, params: CostParams) -> Grid:
    """Every feasible tiled plan of ``problem``, "measured" as the model with ``params`` says."""
    plans = candidate_space(problem, H200, SpaceAxes(families=["tiled"])).feasible
    times = costmodel.predict_many(plans, H200, params)
    return Grid.of(problem.label(), list(zip(plans, times, strict=True)), H200)


@pytest.fixture(scope="module")
def grids() -> list[Grid]:
    return [synthetic_grid(problem, TRUTH) for problem in PROBLEMS]


def test_the_loss_is_zero_at_the_constants_the_data_came_from(grids):
    assert loss(TRUTH, grids, H200) == pytest.approx(0.0, abs=1e-20)
    assert loss(START, grids, H200) > 1e-3


def test_the_fit_gets_the_loss_near_zero_and_recovers_the_ranking(grids):
    fitted = fit(grids[:2], H200, iterations=300)
    assert loss(fitted, grids[:2], H200) < 0.02 * loss(START, grids[:2], H200)
    # Held out: the third grid, never seen by the fit, is ranked as the truth ranks it.
    (tiled,) = score(grids[2], fitted, H200)
    assert tiled.spearman > 0.95
    assert tiled.pick_over_best < 1.05


def test_only_pipes_the_grids_use_are_fitted(grids):
    names = fitted_constants(grids)
    assert "ffma_efficiency" in names
    assert "mma_f16_efficiency" not in names and "mma_tf32_efficiency" not in names
    # tiled loads, waits at its barrier, then computes: only the synchronous overlap
    assert "overlap_synchronous" in names and "overlap" not in names
    fitted = fit(grids[:1], H200, iterations=40)
    assert fitted.mma_f16_efficiency == START.mma_f16_efficiency
    for name in names:
        low, high = BOUNDS[name]
        assert low * (1 - 1e-9) <= getattr(fitted, name) <= high * (1 + 1e-9)


def test_weights_sum_to_one_per_family_and_favour_the_fast_plans(grids):
    grid = grids[0]
    w = weights(grid)
    assert w.sum() == pytest.approx(1.0)
    fastest, slowest = np.argmin(grid.measured_ms), np.argmax(grid.measured_ms)
    assert w[fastest] > w[slowest]


def test_scores_are_what_the_measurements_say():
    problem = PROBLEMS[1]
    plans = candidate_space(problem, H200, SpaceAxes(families=["tiled"])).feasible[:20]
    predicted = costmodel.predict_many(plans, H200, START)
    # Measured in the reverse order of the prediction: Spearman -1, the pick is the slowest.
    order = np.argsort(predicted)
    measured = np.empty(len(plans))
    measured[order] = np.linspace(2.0, 1.0, len(plans))
    grid = Grid.of("reversed", list(zip(plans, measured, strict=True)), H200)
    (row,) = score(grid, START, H200)
    assert row.spearman == pytest.approx(-1.0)
    assert row.pick_over_best == pytest.approx(2.0)
    assert row.best == plans[int(order[-1])].key()


def test_leave_one_out_never_fits_on_the_grid_it_scores(grids, monkeypatch):
    seen: list[list[str]] = []

    def recording_fit(training, device, iterations=0):
        seen.append([grid.label for grid in training])
        return START

    monkeypatch.setattr("tuner.calibration.fit", recording_fit)
    results = leave_one_out(grids, H200)
    assert [held.label for held, _, _ in results] == [grid.label for grid in grids]
    for (held, _, _), training in zip(results, seen, strict=True):
        assert held.label not in training and len(training) == len(grids) - 1


def test_nelder_mead_finds_a_quadratic_minimum():
    target = np.array([0.3, -1.2, 2.0])
    found = nelder_mead(lambda x: float(np.sum((x - target) ** 2)), np.zeros(3), 0.5, 400)
    assert np.allclose(found, target, atol=1e-3)


def test_model_times_matches_predict_plan_by_plan():
    problem = PROBLEMS[2]
    plans = candidate_space(problem, H200).feasible[:30]
    table = model_times(costmodel.feature_table(plans, H200), H200, TRUTH)
    for i, plan in enumerate(plans):
        one = costmodel.predict(plan, H200, TRUTH)
        assert one.time_ms == pytest.approx(float(table["time_ms"][i]))
        assert math.isfinite(one.time_ms)


def test_the_shipped_calibration_loads_and_names_its_sources():
    import json

    data = json.loads(costmodel.CALIBRATION_FILE.read_text())
    assert costmodel.calibrated() == CostParams.from_dict(data["params"])
    assert data["fitted_on"] and all(entry["files"] for entry in data["fitted_on"])
    for label, entry in data["held_out"].items():
        assert (
            CostParams.from_dict(entry["params"]) != costmodel.calibrated()
            or len(data["fitted_on"]) == 1
        ), label
    with pytest.raises(ValueError, match="unknown"):
        CostParams.from_dict({"warp_speed": 9.0})


def test_a_single_measured_plan_counts_a_quarter_of_a_grid(grids):
    from tuner.calibration import FULL_GROUP_PLANS

    grid = grids[0]
    plan_index = int(np.argmin(grid.measured_ms))
    point = Grid(
        "one plan",
        grid.keys[plan_index : plan_index + 1],
        grid.families[plan_index : plan_index + 1],
        {name: column[plan_index : plan_index + 1] for name, column in grid.table.items()},
        grid.measured_ms[plan_index : plan_index + 1] * math.e,  # log error exactly 1
    )
    # The grid itself fits perfectly (TRUTH generated it): the loss is the point's share.
    share = 1 / FULL_GROUP_PLANS
    assert loss(TRUTH, [grid, point], H200) == pytest.approx(share / (1 + share))
