"""The stopping rule in the search: a replayed run that stops early, what the study records,
resuming a stopped study, several workers, and samplers the rule does not apply to."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir
from worker_backends import SlowFactory, log_lines, make_space, settings

import tuner.search
from kernels.backends.model import ModelBackend
from tuner.app import run
from tuner.config import SearchConfig, typed_config, validate
from tuner.device import H200
from tuner.search import RULE_ATTR, STOPPED_ATTR, run_search, stopping_rule
from tuner.study_space import StudySpace
from tuner.study_storage import open_storage
from tuner.workers import GpuPlan, WorkerJob, search_with_workers

ROOT = Path(__file__).resolve().parent.parent
#: the recorded H200 grid of the first evidence shape (490 timed plans, two families)
GRID = ROOT / "bench" / "data" / "h200_mma_f16_wgmma_f16_4x16x4096x128_bf16.json"
SHAPE = ("seq_len=4096", "head_dim=128", "batch=4", "heads=16", "dtype=bfloat16")


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(ROOT / "tuner" / "conf"), version_base="1.3"):
        yield


def replay(where: Path, *overrides: str) -> tuple[int, str]:
    cfg = compose(
        config_name="config",
        overrides=[
            *SHAPE,
            "backend=replay",
            f"backend.replay_path={GRID}",
            f"registry.url=sqlite:///{where / 'plans.sqlite'}",
            f"search.storage=sqlite:///{where / 'studies.sqlite'}",
            *overrides,
        ],
    )
    out = io.StringIO()
    status = run(validate(typed_config(cfg)), output_dir=where / "run", out=out)
    return status, out.getvalue()


def the_study(where: Path) -> optuna.Study:
    storage = f"sqlite:///{where / 'studies.sqlite'}"
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage)


def counted_keys(study: optuna.Study) -> list[str]:
    return [
        str(t.user_attrs["plan_key"])
        for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
        if t.user_attrs.get("outcome") in ("measured", "failed")
    ]


def stored(output: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith("registry: ")]
    return line.split()[1]


# ---------------------------------------------------------------- one replayed run


def test_a_replayed_run_stops_early_and_stores_what_40_trials_store(tmp_path, hydra_conf):
    stopped_dir, full_dir = tmp_path / "stopped", tmp_path / "full"
    status, output = replay(stopped_dir)
    assert status == 0, output
    status_full, output_full = replay(full_dir, "search.stop=false")
    assert status_full == 0, output_full

    early, full = counted_keys(the_study(stopped_dir)), counted_keys(the_study(full_dir))
    assert len(full) == 40 and 4 <= len(early) < 40
    # The rule only ends the search: what it measured is the start of the 40 trials.
    assert early == full[: len(early)]
    assert stored(output) == stored(output_full)
    (line,) = [line for line in output.splitlines() if line.startswith("stopped")]
    assert line.startswith(
        f"stopped after {len(early)} of 40 trials: no unmeasured plan has more than a 5% "
        "chance of beating the best by 2% (the largest: "
    )
    # The last line says where the time went, and how many trials the search ran.
    last = output.splitlines()[-1]
    assert last.startswith("time: ") and f"search ({len(early)} trials, " in last


def test_the_study_records_the_rule_and_where_it_stopped(tmp_path, hydra_conf):
    status, output = replay(tmp_path)
    assert status == 0, output
    study = the_study(tmp_path)
    rule = study.user_attrs[RULE_ATTR]
    assert rule["margin"] == 0.02 and rule["probability"] == 0.05
    assert rule["min_trials"] == 4 and rule["n_trials"] == 40
    record = study.user_attrs[STOPPED_ATTR]
    counted = len(counted_keys(study))
    assert record["counted"] == counted and record["chance"] < 0.05
    last = max(
        t.number for t in study.get_trials(deepcopy=False) if t.user_attrs.get("plan_key")
    )
    assert record["trial"] == last
    assert record["best"] == stored(output) and record["best_ms"] > 0
    assert record["reason"] in output


def test_a_cap_below_the_rule_wins(tmp_path, hydra_conf):
    status, output = replay(tmp_path, "search.n_trials=3", "search.min_trials=3")
    assert status == 0, output
    assert len(counted_keys(the_study(tmp_path))) == 3
    assert "stopped: n_trials=3 reached" in output
    assert STOPPED_ATTR not in the_study(tmp_path).user_attrs


# ---------------------------------------------------------------- resuming


def test_resuming_a_stopped_study_runs_nothing_until_the_settings_change(tmp_path, hydra_conf):
    status, first = replay(tmp_path)
    assert status == 0, first
    done = len(counted_keys(the_study(tmp_path)))

    status, again = replay(tmp_path, "search.n_trials=80")  # the cap did not stop it
    assert status == 0, again
    assert len(counted_keys(the_study(tmp_path))) == done
    assert "0 in this run" in again and "the stopping rule ended this study earlier" in again

    # A stricter rule judges the study afresh and goes on where it is not satisfied.
    status, stricter = replay(tmp_path, "search.stop_probability=0.001")
    assert status == 0, stricter
    more = len(counted_keys(the_study(tmp_path)))
    assert done < more < 40
    assert the_study(tmp_path).user_attrs[STOPPED_ATTR]["probability"] == 0.001

    # Without the rule it runs to the cap.
    status, full = replay(tmp_path, "search.stop=false")
    assert status == 0, full
    assert len(counted_keys(the_study(tmp_path))) == 40
    assert the_study(tmp_path).user_attrs[RULE_ATTR]["rule"] == "off"


def test_switching_the_rule_on_for_a_finished_study_can_end_it_at_once(tmp_path, hydra_conf):
    status, output = replay(tmp_path, "search.stop=false", "search.n_trials=30")
    assert status == 0, output
    status, output = replay(tmp_path, "search.n_trials=40")
    assert status == 0, output
    assert "0 in this run" in output and "stopped after 30 of 40 trials" in output


# ---------------------------------------------------------------- samplers without the rule


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid"])
def test_other_samplers_run_n_trials_and_say_the_rule_is_off(tmp_path, hydra_conf, sampler):
    status, output = replay(tmp_path, f"search.sampler={sampler}", "search.n_trials=12")
    assert status == 0, output
    assert f"search.stop: off (search.sampler={sampler}: the stopping rule" in output
    assert len(counted_keys(the_study(tmp_path))) == 12
    assert the_study(tmp_path).user_attrs[RULE_ATTR]["rule"] == "off"


def test_stop_false_says_nothing_and_runs_n_trials(tmp_path, hydra_conf):
    status, output = replay(tmp_path, "search.stop=false", "search.n_trials=12")
    assert status == 0, output
    assert "search.stop" not in output
    assert len(counted_keys(the_study(tmp_path))) == 12


# ---------------------------------------------------------------- several workers


def candidate_space_of_slow_backend() -> tuple[StudySpace, dict]:
    structured, predictions = make_space()
    space = StudySpace(
        structured.problem,
        structured.device,
        structured.feasible,
        structured.rejected.values(),
        encoding="candidate",
    )
    return space, predictions


def test_a_trial_proposed_before_another_worker_stopped_the_study_is_not_measured(
    tmp_path, monkeypatch
):
    """The race window: a worker has its proposal in hand when another worker's trial
    makes the rule fire. Its trial is given up (``surplus``, ``STOPPED``), unmeasured."""
    space, predictions = candidate_space_of_slow_backend()
    search_settings = SearchConfig(n_trials=40, traffic_cutoff=1e9)
    rule = stopping_rule(search_settings)
    assert rule is not None
    make_sampler = tuner.search.make_sampler

    class OtherWorkerStopsAtTheThirdProposal(optuna.samplers.BaseSampler):
        def __init__(self, inner: optuna.samplers.BaseSampler) -> None:
            self.inner, self.proposals = inner, 0

        def infer_relative_search_space(self, study, trial):  # type: ignore[no-untyped-def]
            return {}

        def sample_relative(self, study, trial, search_space):  # type: ignore[no-untyped-def]
            return {}

        def sample_independent(self, study, trial, name, distribution):  # type: ignore[no-untyped-def]
            self.proposals += 1
            if self.proposals == 3:
                record = rule.settings() | {"trial": 99, "reason": "another worker's verdict"}
                study.set_user_attr(STOPPED_ATTR, record)
            return self.inner.sample_independent(study, trial, name, distribution)

    monkeypatch.setattr(
        tuner.search,
        "make_sampler",
        lambda *args, **kwargs: OtherWorkerStopsAtTheThirdProposal(make_sampler(*args, **kwargs)),
    )
    measured: list[str] = []

    class Counting(ModelBackend):
        def measure(self, plan, problem):  # type: ignore[no-untyped-def]
            measured.append(plan.key())
            return super().measure(plan, problem)

    # enqueue_top=0: every proposal goes through the sampler.
    result = run_search(
        space,
        Counting(H200),
        SearchConfig(n_trials=40, traffic_cutoff=1e9, enqueue_top=0),
        storage=f"sqlite:///{tmp_path / 's.sqlite'}",
        study_name="race",
        predictions=predictions,
    )
    assert len(measured) == 2 and result.counted == 2
    (given_up,) = [t for t in result.trials if t.outcome == "surplus"]
    assert given_up.failure == "STOPPED" and given_up.key not in measured
    assert "trial 99" in given_up.detail
    assert result.stop_reason == "another worker's verdict"
    # Its claim was withdrawn: the slot is free for a later run with other settings.
    trial = optuna.load_study(study_name="race", storage=f"sqlite:///{tmp_path / 's.sqlite'}")
    assert trial.trials[given_up.number].user_attrs.get("claim") is None


def test_workers_sharing_a_study_stop_together_on_the_rule(tmp_path):
    log = str(tmp_path / "log")
    space, predictions = candidate_space_of_slow_backend()
    workers = 4
    job = WorkerJob(
        space=space,
        predictions=predictions,
        settings=settings(n_trials=200, sampler="model"),
        storage_url=f"sqlite:///{tmp_path / 's.sqlite'}",
        study_name="four-stopping",
        backend=SlowFactory(0.05, log),
    )
    result, outcome = search_with_workers(
        job, GpuPlan(workers, (None,) * workers, "test"), open_storage(job.storage_url)
    )
    assert outcome is not None and not outcome.failed, [e.describe() for e in outcome.failed]
    study = optuna.load_study(study_name="four-stopping", storage=job.storage_url)
    record = study.user_attrs[STOPPED_ATTR]
    keys = counted_keys(study)
    assert len(keys) == len(set(keys)) and len(keys) < 200
    # Each worker stops after its trial in hand: at most one each past the verdict.
    assert record["counted"] <= len(keys) <= record["counted"] + workers - 1
    measured = [key for _, key in log_lines(log, "end")]
    assert sorted(measured) == sorted(keys)
    # Every worker stopped on the rule (a worker adopts a verdict already recorded).
    described = stopping_rule(job.settings).describe()  # type: ignore[union-attr]
    assert all(described in e.stop_reason for e in outcome.exits)
    assert result.stop_reason == record["reason"] and result.stopped_by_rule == record
