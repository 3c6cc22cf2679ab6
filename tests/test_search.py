"""The search on real Optuna storage (SQLite in tmp_path), with in-process test backends."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import optuna
import pytest
from faulty_backend import RecordingBackend

from kernels.backends.base import Backend, Measurement
from kernels.backends.replay import ReplayBackend, load_recordings
from tuner.config import SearchConfig
from tuner.costmodel import predict, rank_correlation
from tuner.data_dir import DATA_DIR_VARIABLE
from tuner.device import H200
from tuner.environment import Environment
from tuner.errors import ConfigError
from tuner.planner import SpaceAxes, candidate_space
from tuner.planner.families import families_for
from tuner.planner.tunable import KernelPlan, ResourceUsage
from tuner.problem import Problem
from tuner.recorded_space import within_recording
from tuner.search import (
    FREE_STREAK_LIMIT,
    SearchResult,
    encoding_for,
    run_search,
)
from tuner.study_names import default_storage_url, study_name
from tuner.study_space import StudySpace

REPLAY_DATA = sorted((Path(__file__).parent.parent / "bench" / "data").glob("*.json"))


def make_space(
    problem: Problem, sampler: str = "model", axes: SpaceAxes | None = None
) -> tuple[StudySpace, dict]:
    space = candidate_space(problem, H200, axes or SpaceAxes())
    predictions = {p.key(): predict(p, H200) for p in space.feasible}
    study_space = StudySpace(
        problem, H200, space.feasible, space.rejected, encoding=encoding_for(sampler)
    )
    return study_space, predictions


def search(
    tmp_path: Path,
    space: StudySpace,
    predictions: dict,
    backend: Backend,
    name: str = "study",
    **settings,
) -> SearchResult:
    settings.setdefault("traffic_cutoff", 1e9)
    return run_search(
        space,
        backend,
        SearchConfig(**settings),
        storage=f"sqlite:///{tmp_path / 'studies.sqlite'}",
        study_name=name,
        predictions=predictions,
    )


def ranked_keys(space: StudySpace, predictions: dict) -> list[str]:
    return sorted(space.by_key, key=lambda k: (predictions[k].time_ms, k))


def test_infeasible_points_never_reach_the_backend(tmp_path):
    # head_dim 256: a quarter of the structured space is over the shared-memory limit.
    # (TPE proposes tunable values, so it can name points the planner rejects; the
    # model sampler proposes only feasible plan keys.)
    problem = Problem(1024, 256)
    space, predictions = make_space(problem, sampler="tpe")
    backend = RecordingBackend()  # asserts every plan it sees is feasible
    result = search(
        tmp_path, space, predictions, backend, sampler="tpe", n_trials=30, enqueue_top=0
    )
    assert set(backend.keys) <= set(space.by_key)
    infeasible = [t for t in result.trials if t.outcome == "infeasible"]
    assert infeasible, "the sampler proposed no infeasible point; the test proves nothing"
    for trial in infeasible:
        assert trial.state == "PRUNED" and trial.failure == "INFEASIBLE"
        assert trial.detail and trial.key not in backend.keys
    assert result.counted == 30 == len(backend.keys)


@pytest.mark.parametrize("sampler", ["model", "tpe"])
def test_a_plan_the_compiler_rejected_is_never_measured(tmp_path, sampler):
    problem = Problem(512, 64)
    axes = SpaceAxes(families=("tiled",), tile_sizes=(32,), rows_per_block=(32, 64))
    space = candidate_space(problem, H200, axes)
    spilled = space.feasible[0].with_resources(
        ResourceUsage(registers=255, spill_store_bytes=64), H200
    )
    assert not spilled.feasible and "spills" in spilled.reason
    feasible = space.feasible[1:]
    predictions = {p.key(): predict(p, H200) for p in feasible}
    study_space = StudySpace(
        problem, H200, feasible, (*space.rejected, spilled), encoding=encoding_for(sampler)
    )
    backend = RecordingBackend()
    result = search(  # every feasible plan once: no stopping rule
        tmp_path,
        study_space,
        predictions,
        backend,
        sampler=sampler,
        n_trials=len(feasible),
        stop=False,
    )
    assert spilled.key() not in backend.keys
    assert sorted(backend.keys) == sorted(p.key() for p in feasible)
    for trial in result.trials:
        if trial.key == spilled.key():
            assert trial.outcome == "infeasible" and "spills" in trial.detail


def test_the_best_predictions_are_measured_first_in_predicted_order(tmp_path):
    # TPE does not know the model: the queue is its cost-model ranking.
    space, predictions = make_space(Problem(512, 64), sampler="tpe")
    backend = RecordingBackend()
    result = search(
        tmp_path, space, predictions, backend, sampler="tpe", n_trials=12, enqueue_top=5
    )
    assert backend.keys[:5] == ranked_keys(space, predictions)[:5]
    assert result.enqueued == backend.keys[:5]
    assert [t.key for t in result.trials[:5]] == backend.keys[:5]


def test_the_model_sampler_follows_the_queue_then_corrects_the_ranking(tmp_path):
    space, predictions = make_space(Problem(512, 64))
    ranked = ranked_keys(space, predictions)
    # Every plan of the 6th-ranked plan's tile size runs 3x slower than predicted.
    def tile_of(plan: KernelPlan) -> int | None:
        return plan.params.as_dict().get("tile_size")

    slow_tile = tile_of(space.by_key[ranked[5]])

    class Skewed(RecordingBackend):
        def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
            measurement = super().measure(plan, problem)
            factor = 3.0 if tile_of(plan) == slow_tile else 1.0
            return dataclasses.replace(measurement, median_ms=measurement.median_ms * factor)

    backend = Skewed()
    result = search(tmp_path, space, predictions, backend, n_trials=14, enqueue_top=3)
    assert result.enqueued == ranked[:3] == backend.keys[:3]
    assert len(set(backend.keys)) == len(backend.keys) == 14
    # After the queue, the sampler measures fewer plans of the slow tile than the
    # uncorrected ranking would.
    after = backend.keys[3:]
    uncorrected = [k for k in ranked if k not in backend.keys[:3]][: len(after)]
    def slow(keys: list[str]) -> int:
        return sum(tile_of(space.by_key[k]) == slow_tile for k in keys)

    assert slow(after) < slow(uncorrected)


def test_the_model_sampler_refuses_a_structured_space(tmp_path):
    space, predictions = make_space(Problem(512, 64), sampler="tpe")
    with pytest.raises(ConfigError, match="candidate space"):
        search(tmp_path, space, predictions, RecordingBackend(), sampler="model", n_trials=2)


def test_plans_over_the_traffic_cutoff_are_skipped_and_recorded(tmp_path):
    space, predictions = make_space(Problem(512, 64), sampler="random")
    best = min(p.traffic_bytes for p in predictions.values())
    backend = RecordingBackend()
    result = search(
        tmp_path, space, predictions, backend, sampler="random", n_trials=10, traffic_cutoff=3.0
    )
    measured = {k: predictions[k].traffic_bytes for k in backend.keys}
    assert measured and max(measured.values()) <= 3.0 * best
    skipped = [t for t in result.trials if t.outcome == "skipped"]
    assert skipped and all(t.failure == "TRAFFIC_CUTOFF" and t.state == "PRUNED" for t in skipped)
    assert all(predictions[t.key].traffic_bytes > 3.0 * best for t in skipped)
    assert result.over_cutoff == sum(p.traffic_bytes > 3.0 * best for p in predictions.values())


def test_a_candidate_proposed_again_reuses_its_result(tmp_path):
    space, predictions = make_space(Problem(512, 64))
    plan = space.by_key[ranked_keys(space, predictions)[3]]
    storage = f"sqlite:///{tmp_path / 'studies.sqlite'}"
    study = optuna.create_study(storage=storage, study_name="dup")
    study.enqueue_trial(space.fixed_params(plan))
    study.enqueue_trial(space.fixed_params(plan))
    backend = RecordingBackend()
    result = search(tmp_path, space, predictions, backend, name="dup", n_trials=3, enqueue_top=0)
    first, second = result.trials[0], result.trials[1]
    assert first.key == second.key == plan.key()
    assert backend.keys.count(plan.key()) == 1
    assert second.outcome == "duplicate" and second.duplicate_of == first.number
    assert second.median_ms == first.median_ms and second.state == "COMPLETE"
    assert len(set(backend.keys)) == len(backend.keys) == 3 == result.counted


@pytest.mark.parametrize("sampler", ["model", "tpe", "random", "grid"])
def test_each_sampler_runs_and_measures_distinct_candidates(tmp_path, sampler):
    space, predictions = make_space(Problem(512, 64), sampler=sampler)
    backend = RecordingBackend()
    result = search(
        tmp_path, space, predictions, backend, sampler=sampler, n_trials=15, enqueue_top=2, seed=3
    )
    assert result.counted == 15 == len(backend.keys) == len(set(backend.keys))
    assert result.best is not None and result.best.median_ms == min(
        predictions[k].time_ms for k in backend.keys
    )
    assert result.stop_reason == "n_trials=15 reached"


def test_the_seed_makes_a_search_repeatable(tmp_path):
    space, predictions = make_space(Problem(512, 64))
    runs = []
    for name in ("a", "b"):
        backend = RecordingBackend()
        search(tmp_path, space, predictions, backend, name=name, n_trials=15, seed=7)
        runs.append(backend.keys)
    assert runs[0] == runs[1]


def test_n_trials_is_honoured_and_a_rerun_continues_the_study(tmp_path):
    space, predictions = make_space(Problem(512, 64))
    first_backend = RecordingBackend()
    first = search(tmp_path, space, predictions, first_backend, n_trials=6)
    assert len(first_backend.keys) == 6 == first.counted
    second_backend = RecordingBackend()
    second = search(tmp_path, space, predictions, second_backend, n_trials=10)
    assert len(second_backend.keys) == 4 == second.new_measurements
    assert not set(second_backend.keys) & set(first_backend.keys)
    assert second.counted == 10
    assert {t.number for t in first.trials} < {t.number for t in second.trials}
    third_backend = RecordingBackend()
    third = search(tmp_path, space, predictions, third_backend, n_trials=10)
    assert third_backend.keys == [] and third.stop_reason == "n_trials=10 already reached"


def test_the_search_ends_when_every_candidate_is_evaluated(tmp_path):
    axes = SpaceAxes(families=("tiled",), tile_sizes=(32,), rows_per_block=(32,))
    space, predictions = make_space(Problem(512, 64), axes=axes)
    backend = RecordingBackend()
    result = search(tmp_path, space, predictions, backend, n_trials=100, stop=False)
    assert sorted(backend.keys) == sorted(space.by_key)
    assert result.stop_reason == "every candidate within the traffic cutoff is evaluated"
    # The sampler kept proposing the few plans there are: it was helped along.
    streaks = 0
    for trial in result.trials:
        streaks = 0 if trial.counted else streaks + 1
        assert streaks <= FREE_STREAK_LIMIT


def test_timeout_ends_the_search(tmp_path):
    class Slow(RecordingBackend):
        def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
            time.sleep(0.3)
            return super().measure(plan, problem)

    space, predictions = make_space(Problem(512, 64))
    backend = Slow()
    result = search(tmp_path, space, predictions, backend, n_trials=100, timeout_s=1.0)
    assert 1 <= len(backend.keys) < 10
    assert result.stop_reason.startswith("timeout_s=1 reached")


def test_failures_are_pruned_with_a_constraint_and_do_not_count_as_best(tmp_path):
    class Failing(RecordingBackend):
        calls = 0

        def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
            self.calls += 1
            if self.calls % 2:
                return Measurement.failed(
                    "WRONG_ANSWER",  # type: ignore[arg-type]
                    "max |err| 0.5",
                )
            return super().measure(plan, problem)

    space, predictions = make_space(Problem(512, 64))
    result = search(tmp_path, space, predictions, Failing(), n_trials=8)
    failed = [t for t in result.trials if t.outcome == "failed"]
    assert len(failed) == 4
    assert all(t.state == "PRUNED" and t.failure == "WRONG_ANSWER" for t in failed)
    study = optuna.load_study(
        study_name="study", storage=f"sqlite:///{tmp_path / 'studies.sqlite'}"
    )
    for trial in study.trials:
        if trial.user_attrs["outcome"] == "failed":
            assert trial.constraints == {"failed": 1.0}
    assert result.best is not None and result.best.outcome == "measured"
    assert study.best_trial.user_attrs["plan_key"] == result.best.key


def test_ctrl_c_keeps_finished_trials_and_the_rerun_goes_on(tmp_path):
    class Interrupting(RecordingBackend):
        def measure(self, plan: KernelPlan, problem: Problem) -> Measurement:
            if len(self.seen) == 3:
                raise KeyboardInterrupt
            return super().measure(plan, problem)

    space, predictions = make_space(Problem(512, 64))
    interrupted = search(tmp_path, space, predictions, Interrupting(), n_trials=8)
    assert interrupted.interrupted and interrupted.counted == 3
    assert interrupted.trials[3].state == "FAIL" and interrupted.trials[3].outcome == "interrupted"
    assert interrupted.best is not None
    backend = RecordingBackend()
    resumed = search(tmp_path, space, predictions, backend, n_trials=8)
    assert len(backend.keys) == 5 and resumed.counted == 8
    measured_before = {t.key for t in interrupted.trials if t.counted}
    assert not measured_before & set(backend.keys)


def test_trials_carry_their_evidence_as_user_attributes(tmp_path):
    space, predictions = make_space(Problem(512, 64))
    search(tmp_path, space, predictions, RecordingBackend(), n_trials=2)
    study = optuna.load_study(
        study_name="study", storage=f"sqlite:///{tmp_path / 'studies.sqlite'}"
    )
    attrs = study.trials[0].user_attrs
    key = attrs["plan_key"]
    assert attrs["outcome"] == "measured" and attrs["measured"] is True
    assert set(attrs["params"]) == {
        "family",
        "threads",
        "tile_size",
        "rows_per_block",
        "split_target",
        "sequence_splits",
    }
    assert attrs["predicted"]["ms"] == predictions[key].time_ms
    assert attrs["predicted"]["read_bytes"] == predictions[key].read_bytes
    assert attrs["median_ms"] == study.trials[0].value
    assert set(attrs["timing"]) == {"spread_ms", "tflops", "gbps", "max_abs_error"}


def test_study_names_change_with_the_environment_and_the_kernel_source():
    problem = Problem(4096, 128)
    environment = Environment("NVIDIA H200", "9.0", 132, driver_version="580.1")
    hashes = {"tiled": "aa", "scalar_online": "bb"}
    name = study_name(problem, environment, hashes)
    assert name.startswith("1x1x4096x128-float32-full@nvidia-h200-")
    assert study_name(problem, environment, dict(hashes)) == name
    assert study_name(problem, environment, hashes | {"tiled": "ab"}) != name
    newer = dataclasses.replace(environment, driver_version="580.2")
    assert study_name(problem, newer, hashes) != name
    assert study_name(Problem(4096, 128, causal=True), environment, hashes) != name
    assert study_name(problem, environment, hashes, "replay") == f"{name}-replay"
    assert name.endswith("-tpe")  # the sampler is part of a study's identity
    assert study_name(problem, environment, hashes, sampler="random") == f"{name[:-4]}-random"


def test_problems_that_differ_only_by_a_variant_have_studies_of_their_own():
    # Gemma 2 at an 8192-token prefill: its sliding and its global layers.
    environment = Environment("NVIDIA H200", "9.0", 132)
    shape = dict(heads=16, kv_heads=8, causal=True, dtype="bfloat16", softcap=50.0)
    sliding = Problem(8192, 256, window_left=4095, **shape)
    full = Problem(8192, 256, **shape)
    names = {study_name(p, environment, {}) for p in (sliding, full, Problem(8192, 256))}
    assert len(names) == 3
    assert study_name(sliding, environment, {}).startswith(
        "1x16kv8x8192x256-bfloat16-causal-w4095-cap50@nvidia-h200-"
    )
    # A window that cuts nothing is no window: the plain problem's study.
    uncut = Problem(4096, 256, window_left=4095, **shape)
    assert study_name(uncut, environment, {}) == study_name(
        Problem(4096, 256, **shape), environment, {}
    )


def test_the_default_storage_sits_next_to_the_registry():
    assert default_storage_url("sqlite:////tmp/x/r.sqlite") == "sqlite:////tmp/x/studies.sqlite"
    assert default_storage_url("sqlite:///db/plans.sqlite") == "sqlite:///db/studies.sqlite"
    # A registry on a server: the studies go to the per-user data directory (conftest's).
    data = Path(os.environ[DATA_DIR_VARIABLE])
    assert default_storage_url("postgresql://u:p@h/db") == f"sqlite:///{data / 'studies.sqlite'}"


# ---------------------------------------------------------------- on recorded GPU data


@pytest.mark.skipif(not REPLAY_DATA, reason="no recorded timings under bench/data/")
@pytest.mark.parametrize("path", REPLAY_DATA, ids=lambda p: p.name)
def test_search_on_recorded_timings(tmp_path, path):
    """With a real recording, TPE's 40 measurements find a plan near the recorded best."""
    for index, recording in enumerate(load_recordings(path)):
        problem = recording.problem
        # The families the recording holds (its source hashes): another family's plans
        # would all replay as "not in the file".
        held = [f for f in families_for(problem.dtype) if f in recording.source_hashes]
        # and, as the tuner's replay does, only the plans the recording can answer (a choice
        # added to the planner since, such as a third consumer, lies outside it)
        planned = candidate_space(problem, H200, SpaceAxes(families=held))
        feasible, outside = within_recording(list(planned.feasible), recording)
        space = StudySpace(
            problem, H200, feasible, (*planned.rejected, *outside), encoding=encoding_for("model")
        )
        predictions = {p.key(): predict(p, H200) for p in feasible}
        backend = ReplayBackend(path)
        result = search(tmp_path, space, predictions, backend, name=f"replay-{index}", n_trials=40)
        times = [e.median_ms for e in recording.entries.values() if e.median_ms is not None]
        best_recorded = min(times)
        best_found = result.best
        assert best_found is not None
        assert best_found.measured == recording.measured
        # Better than the median candidate, and within 1.5x of the true best.
        assert best_found.median_ms <= sorted(times)[len(times) // 2]
        assert best_found.median_ms <= 1.5 * best_recorded
        rho = rank_correlation(
            [predictions[k].time_ms if k in predictions else None for k in recording.entries],
            [e.median_ms for e in recording.entries.values()],
        )
        print(f"{path.name} {problem.label()}: cost-model rank correlation {rho:.3f}")
        assert not math.isnan(rho)


def test_replay_data_files_are_valid_json_when_present():
    for path in REPLAY_DATA:
        json.loads(path.read_text())
        assert load_recordings(path)
