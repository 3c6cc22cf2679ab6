"""Many workers, one study: exact counting, each plan measured once, pinning, a killed worker.

No GPU: the model and replay backends through ``tuner.app.run`` (``workers=N``),
and a slow stand-in backend (``worker_backends.SlowBackend``) through
``tuner.workers.run_workers``, all on SQLite studies in tmp_path.
"""

from __future__ import annotations

import io
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir
from optuna.trial import TrialState
from worker_backends import (
    ENVIRONMENT,
    SlowFactory,
    assert_exact,
    log_lines,
    make_space,
    only_study,
    settings,
)

from db import PlanRegistry
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.errors import ConfigError
from tuner.problem import Problem
from tuner.study_space import StudySpace
from tuner.study_storage import open_storage
from tuner.workers import GpuPlan, WorkerJob, plan_gpus, run_workers, search_with_workers

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "replay_model_512x64.json"


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(ROOT / "tuner" / "conf"), version_base="1.3"):
        yield


def tune(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    cfg = compose(
        config_name="config",
        overrides=[
            "seq_len=512",
            "head_dim=64",
            "dtype=float32",
            f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
            f"search.storage=sqlite:///{tmp_path / 's.sqlite'}",
            *overrides,
        ],
    )
    out = io.StringIO()
    status = run(validate(typed_config(cfg)), output_dir=tmp_path / "run", out=out)
    return status, out.getvalue()


def best_rows(tmp_path: Path) -> int:
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'r.sqlite'}", readonly=True) as registry:
        return len(registry.list_best())


# ---------------------------------------------------------------- workers=N through the app


def test_four_model_workers_finish_exactly_n_trials_each_plan_once(tmp_path, hydra_conf):
    status, output = tune(tmp_path, "backend=model", "workers=4", "search.n_trials=24")
    assert status == 0, output
    assert "workers: 4 processes share the study" in output
    assert "stopped: n_trials=24 reached" in output
    assert_exact(only_study(f"sqlite:///{tmp_path / 's.sqlite'}"), 24)
    assert best_rows(tmp_path) == 1
    assert "trials: 24 evaluated by the backend" in output


def test_two_replay_workers_store_one_best_plan(tmp_path, hydra_conf):
    status, output = tune(
        tmp_path,
        "backend=replay",
        f"backend.replay_path={FIXTURE}",
        "workers=2",
        "search.n_trials=12",
    )
    assert status == 0, output
    assert_exact(only_study(f"sqlite:///{tmp_path / 's.sqlite'}"), 12)
    assert best_rows(tmp_path) == 1 and "registry: " in output
    # A rerun of the same command finds the study done.
    status, output = tune(
        tmp_path,
        "backend=replay",
        f"backend.replay_path={FIXTURE}",
        "workers=2",
        "search.n_trials=12",
    )
    assert status == 0 and "n_trials=12 already reached" in output


@pytest.mark.parametrize(
    ("value", "shown"),
    [("0", "0"), ("-2", "-2"), ("1.5", "1.5"), ("many", "many"), ("true", "true")],
)
def test_workers_must_be_a_positive_integer_or_auto(hydra_conf, value, shown):
    cfg = compose(
        config_name="config",
        overrides=["seq_len=512", "head_dim=64", "dtype=float32", f"workers={value}"],
    )
    with pytest.raises(ConfigError) as caught:
        validate(typed_config(cfg))
    assert str(caught.value) == f"workers={shown} is invalid: must be a positive integer or auto"


def test_workers_auto_is_accepted(hydra_conf):
    cfg = compose(
        config_name="config",
        overrides=["seq_len=512", "head_dim=64", "dtype=float32", "workers=auto"],
    )
    assert validate(typed_config(cfg)).config.workers == "auto"


# ---------------------------------------------------------------- GPUs


def test_workers_are_pinned_round_robin_to_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    plan = plan_gpus(4)
    assert plan.gpus == ("3", "5", "3", "5") and plan.env == {}
    assert plan_gpus("auto").gpus == ("3", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,-1,2")  # CUDA stops at the first bad entry
    assert plan_gpus("auto").gpus == ("0", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    none = plan_gpus("auto")
    assert none.count == 1 and none.gpus == (None,)
    assert plan_gpus(3, (["0"], "nvidia-smi")).env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert plan_gpus(3, (["0"], "nvidia-smi")).gpus == ("0", "0", "0")


def test_each_worker_process_sees_only_its_gpu(tmp_path):
    log = str(tmp_path / "log")
    space, predictions = make_space()
    job = WorkerJob(
        space=space,
        predictions=predictions,
        settings=settings(n_trials=8, enqueue_top=4),
        storage_url=f"sqlite:///{tmp_path / 's.sqlite'}",
        study_name="pinned",
        backend=SlowFactory(0.0, log),
        environment=ENVIRONMENT,
    )
    plan = plan_gpus(3, (["0", "1"], "CUDA_VISIBLE_DEVICES=0,1"))
    result, outcome = search_with_workers(job, plan, open_storage(job.storage_url))
    assert outcome is not None and not outcome.failed
    assert sorted(gpu for _, gpu in log_lines(log, "built")) == ["0", "0", "1"]
    assert result.counted == 8 and result.stop_reason == "n_trials=8 reached"


def test_a_worker_on_another_kind_of_gpu_is_refused(tmp_path):
    space, predictions = make_space()
    job = WorkerJob(
        space=space,
        predictions=predictions,
        settings=settings(n_trials=4),
        storage_url=f"sqlite:///{tmp_path / 's.sqlite'}",
        study_name="mixed",
        backend=SlowFactory(0.0, str(tmp_path / "log")),
        environment=ENVIRONMENT | {"gpu_name": "NVIDIA H200"},
    )
    plan = GpuPlan(2, ("0", "1"), "test")
    with pytest.raises(Exception, match="every worker failed; worker 0 \\(GPU 0\\) failed: GPU 0 "):
        run_workers(job, plan)


# ---------------------------------------------------------------- one SQLite study, 8 workers


def test_eight_workers_on_one_sqlite_study_are_exact(tmp_path):
    log = str(tmp_path / "log")
    space, predictions = make_space()
    job = WorkerJob(
        space=space,
        predictions=predictions,
        settings=settings(n_trials=24),
        storage_url=f"sqlite:///{tmp_path / 's.sqlite'}",
        study_name="eight",
        backend=SlowFactory(0.02, log),
    )
    plan = GpuPlan(8, (None,) * 8, "test")
    result, outcome = search_with_workers(job, plan, open_storage(job.storage_url))
    assert outcome is not None and not outcome.failed, [e.describe() for e in outcome.failed]
    keys = assert_exact(only_study(job.storage_url), 24)
    measured = [key for _, key in log_lines(log, "end")]
    assert sorted(measured) == sorted(keys)  # the backend saw each counted plan once
    assert result.counted == 24 and len(log_lines(log, "built")) == 8


def test_eight_workers_with_the_model_sampler_are_exact(tmp_path):
    # The default sampler proposes plan keys and skips those other workers are measuring.
    log = str(tmp_path / "log")
    structured, predictions = make_space()
    space = StudySpace(
        structured.problem,
        structured.device,
        structured.feasible,
        structured.rejected.values(),
        encoding="candidate",
    )
    job = WorkerJob(
        space=space,
        predictions=predictions,
        settings=settings(n_trials=24, sampler="model"),
        storage_url=f"sqlite:///{tmp_path / 's.sqlite'}",
        study_name="eight-model",
        backend=SlowFactory(0.02, log),
    )
    plan = GpuPlan(8, (None,) * 8, "test")
    result, outcome = search_with_workers(job, plan, open_storage(job.storage_url))
    assert outcome is not None and not outcome.failed, [e.describe() for e in outcome.failed]
    keys = assert_exact(only_study(job.storage_url), 24)
    measured = [key for _, key in log_lines(log, "end")]
    assert sorted(measured) == sorted(keys)
    # The model's 8 best predictions were queued once; the rest the samplers proposed.
    assert result.enqueued == sorted(predictions, key=lambda k: predictions[k].time_ms)[:8]


# ---------------------------------------------------------------- a worker killed mid-trial


def kill_during_a_measurement(log: str, count: int, killed: list[int]) -> threading.Thread:
    """SIGKILL the worker that starts the ``count``-th measurement, while it measures."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            started = log_lines(log, "start")
            if len(started) >= count:
                pid = int(started[count - 1][0])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


#: the heartbeat grace period of the kill tests, seconds
GRACE_S = 2


def run_and_kill_one(tmp_path: Path, storage_url: str) -> None:
    """Three workers, one SIGKILLed mid-measurement: its trial is failed after the grace
    period, retried by another worker, and the study still ends with exactly n_trials."""
    log = str(tmp_path / "log")
    space, predictions = make_space()
    n_trials = 18
    job = WorkerJob(
        space=space,
        predictions=predictions,
        settings=settings(n_trials=n_trials, heartbeat_interval_s=1, grace_period_s=GRACE_S),
        storage_url=storage_url,
        study_name="killed",
        backend=SlowFactory(0.4, log),
    )
    killed: list[int] = []
    watcher = kill_during_a_measurement(log, 4, killed)
    storage = open_storage(storage_url, heartbeat_interval_s=1, grace_period_s=GRACE_S)
    result, outcome = search_with_workers(job, GpuPlan(3, (None,) * 3, "test"), storage)
    watcher.join()
    assert outcome is not None and len(killed) == 1
    (dead,) = outcome.failed
    assert dead.pid == killed[0] and dead.exitcode == -signal.SIGKILL
    assert "killed by SIGKILL" in dead.describe()
    trials = only_study(storage_url)
    still_running = [t for t in trials if t.state == TrialState.RUNNING]
    if still_running:
        # The survivors finished every other trial before the dead one's grace period ran out
        # (a loaded machine): nobody failed it yet. The next run does, then runs it again.
        from tuner.search import run_search

        assert len(still_running) == 1, "only the killed worker's trial may be left running"
        time.sleep(GRACE_S + 1.5)
        run_search(
            space,
            SlowFactory(0.0, log)(),
            settings(n_trials=n_trials + 1, heartbeat_interval_s=1, grace_period_s=GRACE_S),
            storage=storage,
            study_name="killed",
            predictions=predictions,
        )
        n_trials += 1
        trials = only_study(storage_url)
    (lost,) = [t for t in trials if t.state == TrialState.FAIL and "outcome" not in t.user_attrs]
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == lost.number]
    assert len(retries) == 1, "the dead worker's trial was not queued again"
    (retry,) = retries
    print(f"retry of trial {lost.number}: trial {retry.number}, {retry.state.name} after the run")
    if retry.state == TrialState.WAITING:  # the others finished first: the next run takes it
        from tuner.search import run_search

        run_search(
            space,
            SlowFactory(0.0, log)(),
            settings(n_trials=n_trials + 1),
            storage=storage,
            study_name="killed",
            predictions=predictions,
        )
        n_trials += 1
        trials = only_study(storage_url)
        (retry,) = [t for t in trials if t.number == retry.number]
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["retry_of"] == lost.number
    assert retry.user_attrs["plan_key"] == lost.user_attrs["claim"][1]
    assert_exact(trials, n_trials)
    # Measured twice: only the plan whose first measurement died with its worker.
    ends = Counter(key for _, key in log_lines(log, "end"))
    assert all(count == 1 for count in ends.values())
    starts = Counter(key for _, key in log_lines(log, "start"))
    assert [k for k, c in starts.items() if c > 1] in ([], [retry.user_attrs["plan_key"]])
    assert result.counted == n_trials or retry.state == TrialState.COMPLETE


def test_a_killed_worker_trial_is_failed_and_retried_sqlite(tmp_path):
    run_and_kill_one(tmp_path, f"sqlite:///{tmp_path / 's.sqlite'}")


def test_study_storage_heartbeat_settings_reach_optuna(tmp_path):
    storage = open_storage(
        f"sqlite:///{tmp_path / 's.sqlite'}", heartbeat_interval_s=3, grace_period_s=7
    )
    assert storage.get_heartbeat_interval() == 3 and storage.grace_period == 7
    callback = storage.get_heartbeat_stale_trial_callback()
    assert isinstance(callback, optuna.storages.RetryHeartbeatStaleTrialCallback)
    study = optuna.create_study(storage=storage)
    assert study.trials == []
    storage.engine.dispose()
    assert Problem(512, 64).label()  # the helper module's problem stays plannable


# ---------------------------------------------------------------- Ctrl-C


def test_ctrl_c_reaches_every_worker_and_the_best_so_far_is_stored(tmp_path):
    import json
    import sqlite3
    import subprocess
    import sys

    study = tmp_path / "s.sqlite"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tuner",
            "seq_len=4096",
            "head_dim=128",
            "dtype=float32",
            "backend=model",
            "workers=2",
            "search.n_trials=400",
            "search.stop=false",  # a search long enough to interrupt
            f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
            f"search.storage=sqlite:///{study}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        claimants: set[str] = set()
        while len(claimants) < 2:  # both workers have measured something
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
            try:
                with sqlite3.connect(f"file:{study}?mode=ro", uri=True) as db:
                    query = "SELECT value_json FROM trial_user_attributes WHERE key = 'claim'"
                    rows = db.execute(query).fetchall()
            except sqlite3.Error:
                continue  # not created yet
            claimants = {json.loads(v)[2] for (v,) in rows if v != "null"}
        process.send_signal(signal.SIGINT)  # the parent only, as a terminal's Ctrl-C would be
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted (Ctrl-C): the study keeps its finished trials" in stdout
    assert "stopped: interrupted (Ctrl-C)" in stdout and "registry: best so far " in stdout
    assert "died" not in stdout and "Traceback" not in stderr
    owners = {
        int(t.user_attrs["claim"][2].split("|")[3])
        for t in only_study(f"sqlite:///{study}")
        if isinstance(t.user_attrs.get("claim"), list)
    }
    assert len(owners) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in owners)


def test_ctrl_c_while_the_workers_start_is_one_clean_interrupt(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group; workers still importing must
    neither print a traceback nor be reported as dead."""
    import os
    import subprocess
    import sys

    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tuner",
            "seq_len=4096",
            "head_dim=128",
            "backend=model",
            "workers=2",
            "search.n_trials=400",
            "search.stop=false",  # a search long enough to interrupt
            f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
            f"search.storage=sqlite:///{tmp_path / 's.sqlite'}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,  # its own group, as a terminal's foreground job
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("workers:"):  # printed just before the workers start
                break
        time.sleep(0.2)  # the spawned interpreters are importing now
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert " died (" not in stdout and not re.search(r"worker \d+ failed", stdout), stdout
