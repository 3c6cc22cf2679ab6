"""The plan registry on a real PostgreSQL server (the throwaway one from conftest.py).

The registry's key behaviours are the SQLite suite's own test functions
(tests/test_registry.py), collected here a second time so that they run with
this module's ``registry`` fixture: a fresh PostgreSQL database per test. The
rest is what differs on a server: migrations, read-only transactions, retried
write conflicts, connection errors, several writer processes, SQLite <->
PostgreSQL transfer, and Optuna's storage on the same server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import optuna
import pytest
import test_registry as shared
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from postgres_server import LOOPBACK, PASSWORD, PASSWORD_ROLE, PostgresServer, closed_loopback_port
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session
from test_registry import H200, SHAPE, measured, one_line, populate, rows
from test_registry_concurrency import check_every_plan_and_the_true_best, run_writers

from db import PlanRegistry, RecordOutcome, RecordStatus, storage, upgrade_registry, writes
from db import registry as registry_module
from db.models import Base
from db.schema import HEAD_REVISION
from tuner.errors import RegistryError

pytestmark = pytest.mark.postgres

CONCURRENT_PLANS_PER_WORKER = 200


@pytest.fixture
def registry(fresh_postgres_url: str) -> Iterator[PlanRegistry]:
    with PlanRegistry.open(fresh_postgres_url) as handle:
        yield handle


# -- the SQLite suite's behaviours, on PostgreSQL ----------------------------------------------
# Assigned, not decorated: marking the shared function objects would mark the SQLite tests too.

test_every_field_round_trips_exactly = shared.test_every_field_round_trips_exactly
test_better_plan_replaces_worse_is_kept_as_history_only = (
    shared.test_better_plan_replaces_worse_is_kept_as_history_only
)
test_predicted_never_beats_measured = shared.test_predicted_never_beats_measured
test_best_across_environments_prefers_measured_then_fastest = (
    shared.test_best_across_environments_prefers_measured_then_fastest
)
test_stale_measured_plan_is_never_served_as_measured = (
    shared.test_stale_measured_plan_is_never_served_as_measured
)
test_record_with_current_hashes_replaces_a_stale_best = (
    shared.test_record_with_current_hashes_replaces_a_stale_best
)
test_nearest_shape_rule = shared.test_nearest_shape_rule
test_nearest_ties_go_to_the_larger_seq_len = shared.test_nearest_ties_go_to_the_larger_seq_len
test_nearest_prefers_a_measured_shape_to_a_nearer_predicted_one = (
    shared.test_nearest_prefers_a_measured_shape_to_a_nearer_predicted_one
)
test_cached_best_is_served_from_the_lru_and_cleared_by_writes = (
    shared.test_cached_best_is_served_from_the_lru_and_cleared_by_writes
)


# -- schema ----------------------------------------------------------------------------------


def test_migrations_build_exactly_the_models(fresh_postgres_url: str) -> None:
    with pytest.raises(RegistryError, match="is empty"):
        PlanRegistry.open(fresh_postgres_url, readonly=True)  # a reader creates nothing
    PlanRegistry.open(fresh_postgres_url).close()
    assert upgrade_registry(fresh_postgres_url) == (HEAD_REVISION, HEAD_REVISION)
    engine = create_engine(fresh_postgres_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"compare_type": True, "compare_server_default": False}
            )
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_writers_opening_an_empty_database_at_once_create_it_once(
    fresh_postgres_url: str,
) -> None:
    # Without the upgrade lock every opener sees "empty" and races to create the tables.
    start = threading.Barrier(6)
    failures: list[BaseException] = []

    def open_and_record(index: int) -> None:
        try:
            start.wait()
            with PlanRegistry.open(fresh_postgres_url) as handle:
                handle.record(SHAPE, H200, measured(1.0 + index))
        except BaseException as e:  # reported below, with the others
            failures.append(e)

    # Daemon threads: should a regression hang them, the test fails instead of the run.
    threads = [threading.Thread(target=open_and_record, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "openers still blocked after 30 s"
    assert failures == []
    with PlanRegistry.open(fresh_postgres_url, readonly=True) as reader:
        assert len(reader.history()) == 6
        assert reader.best(SHAPE, H200).record.median_ms == 1.0  # type: ignore[union-attr]


# -- transactions ----------------------------------------------------------------------------


def test_readonly_handle_is_refused_writes_by_the_server(fresh_postgres_url: str) -> None:
    with PlanRegistry.open(fresh_postgres_url) as writer:
        kept = writer.record(SHAPE, H200, measured(1.0))
    with PlanRegistry.open(fresh_postgres_url, readonly=True) as reader:
        with pytest.raises(RegistryError, match="opened read-only"):
            reader.record(SHAPE, H200, measured(0.5))
        # Past the handle's own check, through the real write path: the server refuses.
        engine = reader._live_engine()
        with (
            pytest.raises(RegistryError, match="read-only transaction") as caught,
            storage.session_scope(engine, reader.url, write=True) as session,
        ):
            writes.record_plan(session, SHAPE, H200, measured(0.5), datetime.now(UTC), None)
        one_line(caught.value)
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SHOW transaction_read_only").scalar() == "on"
        best = reader.best(SHAPE, H200)
        assert best is not None and best.plan_id == kept.plan_id
        assert len(reader.history()) == 1


def test_a_concurrent_writer_cannot_lose_the_better_plan(registry: PlanRegistry) -> None:
    registry.record(SHAPE, H200, measured(3.0))
    outcomes: list[RecordOutcome] = []
    with storage.session_scope(registry._live_engine(), registry.url, write=True) as first:
        better = writes.record_plan(first, SHAPE, H200, measured(1.0), datetime.now(UTC), None)
        assert better.status is RecordStatus.REPLACED_BEST  # not committed yet
        second = threading.Thread(
            target=lambda: outcomes.append(registry.record(SHAPE, H200, measured(2.0)))
        )
        second.start()
        # The second writer must wait for the first's lock on the pointer: had it
        # compared against the committed 3.0 ms best, it would overwrite 1.0 ms.
        second.join(timeout=0.5)
        assert second.is_alive()
    second.join(timeout=30)
    assert [o.status for o in outcomes] == [RecordStatus.KEPT_PREVIOUS_BEST]
    best = registry.best(SHAPE, H200)
    assert best is not None and best.plan_id == better.plan_id and best.record.median_ms == 1.0


def _raise_deadlock(session: Session) -> None:
    # A real server-side error with the deadlock SQLSTATE, as a lost deadlock would raise.
    session.execute(
        text("DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = 'deadlock_detected'; END $$")
    )


def test_a_write_that_loses_a_deadlock_runs_again(registry: PlanRegistry) -> None:
    attempts = []

    def work(session: Session):
        attempts.append(len(attempts))
        outcome = writes.record_plan(session, SHAPE, H200, measured(1.0), datetime.now(UTC), None)
        if len(attempts) == 1:
            _raise_deadlock(session)  # after the insert: the retry must not store it twice
        return outcome

    outcome = registry._write(work, "record a plan")
    assert len(attempts) == 2 and outcome.status is RecordStatus.STORED_NEW_BEST
    assert [s.plan_id for s in registry.history()] == [outcome.plan_id]


def test_a_conflict_that_persists_gives_up_with_one_line(
    registry: PlanRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_module, "WRITE_ATTEMPTS", 3)
    attempts = []

    def work(session: Session) -> None:
        attempts.append(1)
        _raise_deadlock(session)

    with pytest.raises(storage.WriteConflict) as caught:
        registry._write(work, "record a plan")
    assert len(attempts) == 3 and "write conflict" in one_line(caught.value)


def test_four_processes_writing_at_once_keep_every_plan_and_the_true_best(
    fresh_postgres_url: str,
) -> None:
    # The workers also open the empty database at once: creating the schema must serialise.
    run_writers(fresh_postgres_url, CONCURRENT_PLANS_PER_WORKER)
    check_every_plan_and_the_true_best(fresh_postgres_url, CONCURRENT_PLANS_PER_WORKER)


# -- transfer --------------------------------------------------------------------------------


def test_export_and_import_between_sqlite_and_postgres(
    registry: PlanRegistry, tmp_path: Path
) -> None:
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'source.sqlite'}") as source:
        populate(source)
        assert source.export(tmp_path / "from-sqlite.json") == 4
        summary = registry.import_(tmp_path / "from-sqlite.json")
        assert (summary.added, summary.skipped) == (4, 0)
        assert rows(registry) == rows(source)
        expected_best = [(s.problem, s.environment, s.record) for s in source.list_best()]
    assert [(s.problem, s.environment, s.record) for s in registry.list_best()] == expected_best
    again = registry.import_(tmp_path / "from-sqlite.json")
    assert (again.added, again.skipped) == (0, 4)

    assert registry.export(tmp_path / "from-postgres.json") == 4
    with PlanRegistry.open(f"sqlite:///{tmp_path / 'copy.sqlite'}") as copy:
        assert copy.import_(tmp_path / "from-postgres.json").added == 4
        assert rows(copy) == rows(registry)
        assert [(s.problem, s.environment, s.record) for s in copy.list_best()] == expected_best


# -- connection errors: one line naming host:port and database --------------------------------


def test_an_unreachable_server_is_one_quick_line(postgres_server: PostgresServer) -> None:
    port = closed_loopback_port()
    url = f"postgresql+psycopg://postgres@{LOOPBACK}:{port}/registry"
    for readonly in (False, True):
        started = time.monotonic()
        with pytest.raises(RegistryError) as caught:
            PlanRegistry.open(url, readonly=readonly)
        assert time.monotonic() - started < storage.CONNECT_TIMEOUT_S
        message = one_line(caught.value)
        assert "cannot reach the PostgreSQL server" in message
        assert f"{LOOPBACK}:{port}" in message and "'registry'" in message


def test_bad_credentials_and_a_missing_database_are_one_line(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    place = f"{LOOPBACK}:{postgres_server.port}"
    wrong = postgres_server.url("tuner", user=PASSWORD_ROLE, password="not-the-password")
    with pytest.raises(RegistryError) as caught:
        PlanRegistry.open(wrong)
    message = one_line(caught.value)
    assert f"server at {place} refused user '{PASSWORD_ROLE}'" in message
    assert "'tuner'" in message and "not-the-password" not in message

    # The same role with its password gets in: the refusal above was the password's.
    right = create_engine(postgres_server.url("tuner", user=PASSWORD_ROLE, password=PASSWORD))
    try:
        with right.connect() as connection:
            assert connection.exec_driver_sql("SELECT current_user").scalar() == PASSWORD_ROLE
    finally:
        right.dispose()

    with pytest.raises(RegistryError) as caught:
        PlanRegistry.open(postgres_server.url("no_such_database"), readonly=True)
    message = one_line(caught.value)
    assert f"'no_such_database' does not exist on the PostgreSQL server at {place}" in message


# -- Optuna on the same server ---------------------------------------------------------------


def test_optuna_rdb_storage_works_on_the_fixture_server(postgres_url: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rdb = optuna.storages.RDBStorage(postgres_url)
    try:
        study = optuna.create_study(storage=rdb, study_name="fixture-check", direction="minimize")
        study.optimize(lambda trial: trial.suggest_float("x", -1.0, 1.0) ** 2, n_trials=1)
        # A second client, by URL, sees the stored trial.
        loaded = optuna.load_study(study_name="fixture-check", storage=postgres_url)
        assert [t.state for t in loaded.trials] == [optuna.trial.TrialState.COMPLETE]
        assert loaded.best_value == study.best_value
    finally:
        rdb.engine.dispose()
