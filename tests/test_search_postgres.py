"""Optuna studies on PostgreSQL (the throwaway server of ``tests/postgres_server.py``).

A study runs to exactly ``n_trials`` on the server with the model and replay
backends, continues on a rerun, shares the server with the registry (each in
a database of its own), and holds its count and its "each plan once" with
four workers and with a worker killed mid-trial.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from faulty_backend import RecordingBackend
from hydra import compose, initialize_config_dir
from postgres_server import LOOPBACK, PostgresServer, closed_loopback_port
from worker_backends import assert_exact, make_space, only_study, settings

from db import PlanRegistry
from kernels.backends.replay import ReplayBackend
from tuner.app import run
from tuner.config import typed_config, validate
from tuner.errors import ConfigError
from tuner.problem import Problem
from tuner.search import run_search
from tuner.study_storage import open_storage

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "replay_model_512x64.json"


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(ROOT / "tuner" / "conf"), version_base="1.3"):
        yield


def tune(*overrides: str, out: io.StringIO, tmp_path: Path) -> int:
    cfg = compose(
        config_name="config", overrides=["seq_len=512", "head_dim=64", "dtype=float32", *overrides]
    )
    return run(validate(typed_config(cfg)), output_dir=tmp_path / "run", out=out)


def test_a_study_on_postgres_runs_to_n_trials_and_continues(fresh_postgres_url):
    space, predictions = make_space()
    first = RecordingBackend()
    result = run_search(
        space,
        first,
        settings(n_trials=12),
        storage=fresh_postgres_url,
        study_name="pg",
        predictions=predictions,
    )
    assert result.counted == 12 == len(first.keys) and result.stop_reason == "n_trials=12 reached"
    assert "***" not in result.storage_url and result.storage_url.startswith("postgresql+psycopg")
    second = RecordingBackend()
    resumed = run_search(
        space,
        second,
        settings(n_trials=16),
        storage=fresh_postgres_url,
        study_name="pg",
        predictions=predictions,
    )
    assert len(second.keys) == 4 and not set(second.keys) & set(first.keys)
    assert_exact(only_study(fresh_postgres_url), 16)
    assert resumed.best is not None


def test_a_replay_study_on_postgres(fresh_postgres_url):
    space, predictions = make_space()
    result = run_search(
        space,
        ReplayBackend(FIXTURE),
        settings(n_trials=10),
        storage=fresh_postgres_url,
        study_name="replay",
        predictions=predictions,
    )
    assert result.counted == 10 and result.best is not None
    assert_exact(only_study(fresh_postgres_url), 10)


def test_study_and_registry_share_one_server(postgres_server: PostgresServer, tmp_path, hydra_conf):
    studies = postgres_server.create_database("shared_studies")
    plans = postgres_server.create_database("shared_plans")
    out = io.StringIO()
    status = tune(
        "backend=model",
        "search.n_trials=8",
        f"search.storage={studies}",
        f"registry.url={plans}",
        out=out,
        tmp_path=tmp_path,
    )
    assert status == 0, out.getvalue()
    assert_exact(only_study(studies), 8)
    with PlanRegistry.open(plans, readonly=True) as registry:
        best = registry.best(Problem(512, 64))
    assert best is not None and best.record.study_name == optuna.get_all_study_names(studies)[0]
    assert f"stored in {plans}" in out.getvalue()


def test_the_study_may_not_use_the_registry_database(postgres_url, tmp_path, hydra_conf):
    with pytest.raises(ConfigError) as caught:
        tune(
            "backend=model",
            f"search.storage={postgres_url}",
            f"registry.url={postgres_url}",
            out=io.StringIO(),
            tmp_path=tmp_path,
        )
    message = str(caught.value)
    assert message.startswith(f"search.storage={postgres_url} is invalid: it is the registry's")
    assert "\n" not in message


def test_an_unreachable_study_server_is_one_line():
    url = f"postgresql+psycopg://postgres@{LOOPBACK}:{closed_loopback_port()}/optuna"
    with pytest.raises(ConfigError) as caught:
        open_storage(url)
    assert str(caught.value).startswith(f"search.storage={url} cannot be opened: ")
    assert "\n" not in str(caught.value)


def test_four_workers_on_postgres_are_exact(postgres_server: PostgresServer, tmp_path, hydra_conf):
    studies = postgres_server.create_database("four_studies")
    out = io.StringIO()
    status = tune(
        "backend=model",
        "workers=4",
        "search.n_trials=16",
        f"search.storage={studies}",
        f"registry.url=sqlite:///{tmp_path / 'r.sqlite'}",
        out=out,
        tmp_path=tmp_path,
    )
    assert status == 0, out.getvalue()
    assert "workers: 4 processes share the study" in out.getvalue()
    assert_exact(only_study(studies), 16)


def test_a_killed_worker_trial_is_failed_and_retried_postgres(fresh_postgres_url, tmp_path):
    from test_workers import run_and_kill_one

    run_and_kill_one(tmp_path, fresh_postgres_url)
