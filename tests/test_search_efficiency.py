"""bench/search_efficiency.py: the trials-to-within-5% arithmetic, and a small run on real data."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import search_efficiency as se  # noqa: E402

from tuner.search import open_storage  # noqa: E402
from tuner.trials import TrialOutcome  # noqa: E402

REPLAY_DATA = sorted((BENCH / "data").glob("*.json"))


def trial(number: int, outcome: str, median_ms: float | None = None) -> TrialOutcome:
    return TrialOutcome(
        number=number,
        state="COMPLETE" if outcome in ("measured", "duplicate") else "PRUNED",
        outcome=outcome,
        key=f"plan{number}",
        params={},
        median_ms=median_ms,
    )


# ---------------------------------------------------------------- the arithmetic


def test_trials_to_within_counts_to_the_first_trial_inside_the_band():
    curve = [math.inf, 2.0, 1.2, 1.06, 1.05, 1.0, 1.0]
    assert se.trials_to_within(curve) == 5  # 1.05 is within 5%
    assert se.trials_to_within(curve, 1.0) == 6
    assert se.trials_to_within(curve, 1.1) == 4
    assert se.trials_to_within([1.0]) == 1
    assert se.trials_to_within([math.inf, 1.3, 1.2]) is None
    assert se.trials_to_within([]) is None


def test_best_so_far_counts_failures_not_free_proposals_and_pads_to_the_budget():
    trials = [
        trial(0, "failed"),  # counts, times nothing
        trial(1, "infeasible"),  # free
        trial(2, "measured", 2.0),
        trial(3, "duplicate", 2.0),  # free
        trial(4, "measured", 3.0),
        trial(5, "measured", 1.04),
    ]
    curve = se.best_so_far(reversed(trials), grid_best_ms=1.0, budget=6)
    assert curve == [math.inf, 2.0, 2.0, 1.04, 1.04, 1.04]
    assert se.trials_to_within(curve) == 4
    assert se.best_so_far(trials, 1.0, budget=2) == [math.inf, 2.0]
    assert se.best_so_far([], 1.0, budget=3) == [math.inf] * 3


def test_quantiles_rank_never_last_and_report_it_as_none():
    assert se.quantile([1, 2, 3, 4], 0.5) == 2.5
    assert se.quantile([1, 2, math.inf], 0.5) == 2
    assert se.quantile([1, math.inf, math.inf], 0.5) == math.inf
    assert se.quantile([1, 2, math.inf], 0.75) == math.inf
    summary = se.trials_summary([3, None, 5, 1], budget=60)
    assert summary["median"] == 4  # 1, 3, 5, never -> between 3 and 5
    assert summary["q25"] == 2.5 and summary["q75"] is None
    assert summary["never"] == 1 and summary["seeds"] == 4 and summary["per_seed"][1] is None


def test_ratio_of_medians_is_a_lower_bound_when_random_never_gets_there():
    default = {"median": 2.0, "budget": 60}
    assert se.ratio_of_medians({"median": 10.0, "budget": 60}, default) == {
        "value": 5.0,
        "lower_bound": False,
    }
    assert se.ratio_of_medians({"median": None, "budget": 60}, default) == {
        "value": 30.5,
        "lower_bound": True,
    }
    assert (
        se.ratio_of_medians({"median": 3.0, "budget": 60}, {"median": None, "budget": 60})["value"]
        is None
    )


def test_random_median_expected_matches_the_closed_form_and_a_brute_force():
    # One good plan of ten: P(miss after t) = (10 - t) / 10, first <= 1/2 at t = 5.
    assert se.random_median_expected(10, 1) == 5
    assert se.random_median_expected(10, 10) == 1
    assert se.random_median_expected(10, 0) is None
    import itertools

    plans, good = 7, 2
    firsts = sorted(
        min(order.index(g) for g in range(good)) + 1
        for order in itertools.permutations(range(plans))
    )
    brute = next(t for t in range(1, plans + 1) if sum(f > t for f in firsts) <= len(firsts) / 2)
    assert se.random_median_expected(plans, good) == brute


# ---------------------------------------------------------------- on recorded data


@pytest.mark.skipif(not REPLAY_DATA, reason="no recorded timings under bench/data/")
def test_in_memory_storage_replays_the_same_trials_as_the_tuners_sqlite(tmp_path):
    setup = se.setup_problem(min(REPLAY_DATA, key=lambda p: p.stat().st_size), 0)
    for variant in ("default", "random"):
        sqlite = open_storage(f"sqlite:///{tmp_path / (variant + '.sqlite')}")
        on_disk = se.search_once(setup, variant, seed=3, budget=10, storage=sqlite)
        in_memory = se.search_once(setup, variant, seed=3, budget=10)
        assert [(t.key, t.outcome) for t in on_disk] == [(t.key, t.outcome) for t in in_memory]


@pytest.mark.skipif(not REPLAY_DATA, reason="no recorded timings under bench/data/")
def test_a_small_run_on_the_smallest_recording_writes_sane_json(tmp_path):
    smallest = min(REPLAY_DATA, key=lambda p: p.stat().st_size)
    out, png = tmp_path / "efficiency.json", tmp_path / "efficiency.png"
    argv = ["--data", str(smallest), "--seeds", "2", "--budget", "12", "--jobs", "1"]
    assert se.main([*argv, "--out", str(out), "--png", str(png)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["seeds"] == 2 and report["settings"]["budget"] == 12
    assert report["problems"], "no problem reported"
    for entry in report["problems"]:
        best = entry["grid_best"]
        assert best["ms"] > 0 and entry["timed_plans"] <= entry["feasible_plans"]
        rho = entry["cost_model"]["spearman"]
        assert rho is None or -1 <= rho <= 1
        assert set(entry["variants"]) == set(se.DEFAULT_VARIANTS)
        assert entry["held_out"] in (True, False) and entry["family"] == "all"
        for result in entry["variants"].values():
            trials = result["trials_to_within_5pct"]
            assert len(trials["per_seed"]) == 2
            assert all(t is None or 1 <= t <= 12 for t in trials["per_seed"])
            median = result["curve"]["median"]
            assert len(median) == 12
            finite = [v for v in median if v is not None]
            assert all(v >= 1 - 1e-9 for v in finite)
            assert finite == sorted(finite, reverse=True)  # best so far never worsens
        # The default search enqueues the cost model's best first: its first trial is timed.
        assert entry["variants"]["default"]["curve"]["median"][0] is not None
        assert "default_median_within_target" in entry["targets"]
        for result in entry["variants"].values():
            fractions = result["fraction_within"]
            assert set(fractions) == {"10"}  # 20 is past the budget of 12
            per_seed = result["trials_to_within_5pct"]["per_seed"]
            assert fractions["10"] == sum(1 for t in per_seed if t is not None and t <= 10) / 2
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not REPLAY_DATA, reason="no recorded timings under bench/data/")
def test_a_problem_recorded_in_two_files_is_searched_as_one(tmp_path):
    import dataclasses

    from kernels.backends.replay import load_recordings, write_recordings

    def families(path: Path) -> int:
        return len({e.params["family"] for e in load_recordings(path)[0].entries.values()})

    several = [path for path in REPLAY_DATA if families(path) > 1]
    if not several:
        pytest.skip("no recording under bench/data holds two families")
    smallest = min(several, key=lambda p: p.stat().st_size)
    recording = load_recordings(smallest)[0]
    by_family: dict[str, dict] = {}
    for key, entry in recording.entries.items():
        by_family.setdefault(entry.params["family"], {})[key] = entry
    assert len(by_family) > 1, "the recording holds one family; the test proves nothing"
    paths = []
    for family, entries in by_family.items():
        part = dataclasses.replace(
            recording,
            entries=entries,
            source_hashes={family: recording.source_hashes[family]},
        )
        path = tmp_path / f"{family}.json"
        write_recordings(path, [part])
        paths.append(path)
    groups = se.problems_by_shape(paths)
    assert list(groups) == [recording.problem]
    assert len(groups[recording.problem]) == len(by_family)
    (first, *others) = groups[recording.problem]
    merged = se.setup_problem(*first, also=others)
    whole = se.setup_problem(smallest, 0)
    assert merged.times == whole.times and merged.sources == tuple(paths)
    family = sorted(by_family)[0]
    one = se.setup_problem(*first, also=others, family=family)
    assert one.times == {k: v for k, v in whole.times.items() if k.startswith(family + "/")}
    trials = se.search_once(merged, "default", seed=0, budget=4)
    assert sum(1 for t in trials if t.counted) == 4


@pytest.mark.skipif(not REPLAY_DATA, reason="no recorded timings under bench/data/")
def test_held_out_predictions_use_the_constants_fitted_without_the_grid():
    from tuner.costmodel import calibrated

    path = min(REPLAY_DATA, key=lambda p: p.stat().st_size)
    label = se.load_recordings(path)[0].problem.label()
    params = se.held_out_params(label)
    if params is None:
        pytest.skip(f"the shipped calibration has no held-out constants for {label}")
    assert params != calibrated()
    held_out = se.setup_problem(path, 0, held_out=True)
    in_sample = se.setup_problem(path, 0)
    assert held_out.held_out and not in_sample.held_out
    key = next(iter(held_out.times))
    assert held_out.predictions[key].time_ms != in_sample.predictions[key].time_ms


def test_recorded_ptxas_reports_judge_plans_as_precompile_does():
    import ptxas_resources

    from kernels import build
    from tuner.device import H200
    from tuner.planner import KernelParams, plan_kernel
    from tuner.problem import Problem

    problem = Problem(4096, 128, batch=4, heads=16, dtype="bfloat16")

    def plan(**params):
        chosen = plan_kernel(problem, KernelParams("mma_f16", split_target=2**16, **params), H200)
        assert chosen.feasible, chosen.reason
        return chosen

    small = plan(block_m=64, block_n=32, warps=4, stages=2)
    spilled = plan(block_m=128, block_n=64, warps=4, stages=2)
    unknown = plan(block_m=64, block_n=64, warps=4, stages=3)
    report = {"registers": 160, "spill_store_bytes": 0, "spill_load_bytes": 0}
    reports = {
        build.KernelSpec.from_plan(small).key: report,
        build.KernelSpec.from_plan(spilled).key: report | {"spill_store_bytes": 32},
    }
    accepted, rejected = ptxas_resources.judged([small, spilled, unknown], reports, H200)
    assert [p.key() for p in rejected] == [spilled.key()] and "spills" in rejected[0].reason
    judged_small, kept = accepted
    assert judged_small.resources is not None and judged_small.blocks_per_sm == 3  # registers
    assert kept is unknown  # no report: the planner's judgement stands
