"""Runs killed with SIGKILL at awkward moments, and SIGTERM handled as Ctrl-C.

* A worker killed between Optuna's ``ask()`` and its heartbeat thread's first beat
  leaves a RUNNING trial without a heartbeat, which Optuna's stale check never
  looks at: the next run fails it (and queues it again) once the grace period is
  over, instead of leaving it RUNNING forever.
* A worker killed after writing its trial's outcome but before finishing the trial
  leaves a RUNNING trial that looks measured: it does not count, so the next run
  never reports more trials done than ``search.n_trials``.
* SIGTERM (``kill PID``, ``timeout``, a scheduler's stop) stores the best so far,
  says so and exits 143, where it used to exit at once with nothing stored.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from faulty_backend import RecordingBackend
from hydra import compose, initialize_config_dir
from interrupted_tuner import interrupt_tuner
from optuna.trial import TrialState

import tuner.app as app
from db import PlanRegistry
from tuner.app import _trials_done, run
from tuner.claims import fail_silent
from tuner.config import SearchConfig, typed_config, validate
from tuner.costmodel import predict
from tuner.device import H200
from tuner.planner import candidate_space
from tuner.problem import Problem
from tuner.search import encoding_for, run_search, study_trials
from tuner.study_space import StudySpace
from tuner.study_storage import open_storage
from tuner.termination import sigterm_as_ctrl_c

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "tuner" / "conf"
PROBLEM = Problem(512, 64)
GRACE_S = 1
# Asking for a trial outside optimize() is what a dying worker did; Optuna warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")


def space_and_predictions() -> tuple[StudySpace, dict]:
    space = candidate_space(PROBLEM, H200)
    predictions = {p.key(): predict(p, H200) for p in space.feasible}
    study_space = StudySpace(
        PROBLEM, H200, space.feasible, space.rejected, encoding=encoding_for("model")
    )
    return study_space, predictions


def settings(n_trials: int) -> SearchConfig:
    return SearchConfig(
        n_trials=n_trials, traffic_cutoff=1e9, heartbeat_interval_s=1, grace_period_s=GRACE_S
    )


def states(url: str, name: str) -> list[str]:
    storage = open_storage(url, heartbeat_interval_s=1, grace_period_s=GRACE_S)
    try:
        study = optuna.load_study(study_name=name, storage=storage)
        return [t.state.name for t in study.get_trials(deepcopy=False)]
    finally:
        storage.engine.dispose()


def test_a_trial_killed_before_its_first_heartbeat_is_failed_and_run_again(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'studies.sqlite'}"
    space, predictions = space_and_predictions()
    first = run_search(
        space,
        RecordingBackend(),
        settings(3),
        storage=url,
        study_name="s",
        predictions=predictions,
    )
    assert first.counted == 3
    # A worker that asks for a trial and dies before its heartbeat thread beats once.
    script = textwrap.dedent(
        f"""
        import os, signal, optuna
        from tuner.study_storage import open_storage
        storage = open_storage({url!r}, heartbeat_interval_s=1, grace_period_s={GRACE_S})
        study = optuna.load_study(study_name="s", storage=storage)
        study.ask()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert states(url, "s").count("RUNNING") == 1
    time.sleep(GRACE_S + 1.0)

    backend = RecordingBackend()
    second = run_search(
        space, backend, settings(5), storage=url, study_name="s", predictions=predictions
    )
    assert states(url, "s").count("RUNNING") == 0
    (dead,) = [t for t in second.trials if t.state == "FAIL" and t.outcome == "interrupted"]
    assert not any(t.counted for t in second.trials if t.number == dead.number)
    assert second.counted == 5 and len(backend.keys) == 2


def test_a_fresh_trial_without_a_heartbeat_yet_is_left_alone(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'studies.sqlite'}"
    storage = open_storage(url, heartbeat_interval_s=1, grace_period_s=60)
    try:
        study = optuna.create_study(storage=storage, study_name="s")
        trial = study.ask()
        assert fail_silent(study) == []
        assert study.get_trials()[trial.number].state == TrialState.RUNNING
    finally:
        storage.engine.dispose()


def test_a_killed_trial_that_wrote_its_outcome_does_not_count(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'studies.sqlite'}"
    space, predictions = space_and_predictions()
    done = run_search(
        space,
        RecordingBackend(),
        settings(3),
        storage=url,
        study_name="s",
        predictions=predictions,
    )
    assert done.counted == 3
    storage = open_storage(url, heartbeat_interval_s=1, grace_period_s=60)
    try:
        study = optuna.load_study(study_name="s", storage=storage)
        # What a worker killed between its outcome's write and tell() leaves behind.
        trial = study.ask()
        plan = space.feasible[-1]
        written = {"plan_key": plan.key(), "outcome": "measured", "median_ms": 0.1}
        for name, value in written.items():
            trial.set_user_attr(name, value)
        assert _trials_done(storage, "s") == 3
        outcomes = {t.number: t for t in study_trials(storage, "s")}
        assert outcomes[trial.number].outcome == "running"
        assert not outcomes[trial.number].counted
    finally:
        storage.engine.dispose()


def test_sigterm_stores_the_best_so_far_and_exits_143(tmp_path: Path) -> None:
    urls = [
        f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
        f"search.storage=sqlite:///{tmp_path / 's.sqlite'}",
    ]
    done = interrupt_tuner(
        [
            "seq_len=4096",
            "head_dim=128",
            "dtype=float32",
            "backend=model",
            "search.n_trials=400",
            *urls,
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
        tmp_path / "s.sqlite",
        signal.SIGTERM,
    )
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == 143, stderr
    assert "interrupted (SIGTERM): the study keeps its finished trials" in stdout
    assert "stopped: interrupted (SIGTERM)" in stdout
    assert "registry: best so far " in stdout and "Traceback" not in stderr
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        assert registry.best(Problem(4096, 128)) is not None


def test_sigterm_in_process_is_ctrl_c_with_its_own_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app itself: a SIGTERM while the search runs (sent by the backend, from inside
    a measurement) ends the run as Ctrl-C would, with status 143."""

    class TerminatedOnThirdMeasurement(RecordingBackend):
        def measure(self, plan, problem):  # type: ignore[no-untyped-def]
            if len(self.keys) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().measure(plan, problem)

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "seq_len=512",
                "head_dim=64",
                "dtype=float32",
                "backend=model",
                "search.n_trials=20",
                f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
                f"search.storage=sqlite:///{tmp_path / 's.sqlite'}",
            ],
        )
    validated = validate(typed_config(cfg))
    monkeypatch.setattr(app, "_build_backend", lambda *_: TerminatedOnThirdMeasurement())
    out = io.StringIO()
    with sigterm_as_ctrl_c():
        status = run(validated, output_dir=tmp_path / "run", out=out)
    assert status == 143
    assert "interrupted (SIGTERM)" in out.getvalue()
    assert "registry: best so far " in out.getvalue()
