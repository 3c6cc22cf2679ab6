"""Where a study's trials live: Optuna's RDB storage on SQLite or PostgreSQL.

    storage = open_storage(url, heartbeat_interval_s=30, grace_period_s=None)

One storage object (one SQLAlchemy engine) serves a whole run. Every worker
process of a run opens its own on the same URL; they share the study through
the database, and ``tuner.claims`` keeps their trial counting and their
measurements exact.

Heartbeats: every running trial records one every ``heartbeat_interval_s``.
A trial silent for ``grace_period_s`` (default: twice the interval) belongs to
a worker that died (SIGKILL, OOM, a lost host); the next worker to start a
trial or to wait for a slot fails it, and ``RetryHeartbeatStaleTrialCallback``
(the name ``RetryFailedTrialCallback`` has in Optuna 5) queues a copy with the
same parameters, which the next free worker runs first.

SQLite (the default, one host) gets WAL with ``synchronous=NORMAL`` (commits
without an fsync; readers and the writer never block each other; crash-safe),
a busy timeout of ``SQLITE_BUSY_TIMEOUT_S`` so concurrent workers queue for the
write lock, and ``BEGIN IMMEDIATE`` for every transaction: Optuna's writes read
a row and then update it in one transaction, and in WAL a transaction that
read an older snapshot cannot upgrade to a writer at all (SQLITE_BUSY at once,
whatever the timeout, "database is locked"); taking the write lock first makes
each of them wait in the busy handler instead. PostgreSQL
(``postgresql+psycopg://...``, the ``postgres`` extra) gets a connect timeout
and pre-ping, so a restarted server costs a reconnect, not a run.

Journal storage (``optuna.storages.journal.JournalFileBackend``) was measured
as the alternative for several workers on one host without a server and is not
offered: Optuna implements heartbeats only for RDB storage, so a worker killed
mid-trial would hold its trial (and its claim on a slot) forever.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sqlite3
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from tuner.database_errors import database_message, missing_driver
from tuner.database_kinds import REGISTRY, kind_of, sqlite_tables
from tuner.errors import ConfigError

#: seconds between heartbeats of a running trial
HEARTBEAT_INTERVAL_S = 30
#: times a trial whose worker died is queued again (then it stays failed)
MAX_RETRY = 3
SQLITE_BUSY_TIMEOUT_S = 60.0
#: libpq's connect_timeout: an unreachable server is a quick error, not a hang
PG_CONNECT_TIMEOUT_S = 10
#: creating Optuna's tables races when several processes open a new database at once
OPEN_ATTEMPTS = 5


def open_storage(
    url: str,
    *,
    heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S,
    grace_period_s: int | None = None,
    max_retry: int = MAX_RETRY,
    sqlite_begin: str = "BEGIN IMMEDIATE",
) -> RDBStorage:
    """Optuna's RDB storage at ``url``; ``ConfigError`` (one line) when it cannot be opened.

    A SQLite file (and directories) created for it are removed again when the
    open fails or is interrupted: a failed run leaves no empty study database.
    ``sqlite_begin`` is there for ``bench/storage_workers.py``, which compares
    ``BEGIN IMMEDIATE`` with SQLite's default ``BEGIN`` (DEFERRED).
    """
    new_paths = _new_sqlite_paths(url)
    try:
        return _open_storage(url, heartbeat_interval_s, grace_period_s, max_retry, sqlite_begin)
    except BaseException:
        _remove_new(new_paths)
        raise


def _new_sqlite_paths(url: str) -> list[Path]:
    """The SQLite file of ``url`` and its missing directories, deepest first, if it is new."""
    if _backend_name(url) != "sqlite":
        return []
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return []
    path = Path(database).expanduser()
    if path.exists():
        return []
    new = [path]
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        new.append(parent)
        parent = parent.parent
    return new


def _remove_new(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            if path.is_dir():
                path.rmdir()  # only if empty: nothing but what this open created
            else:
                for suffix in ("", "-wal", "-shm", "-journal"):
                    path.with_name(path.name + suffix).unlink(missing_ok=True)


def _open_storage(
    url: str,
    heartbeat_interval_s: int,
    grace_period_s: int | None,
    max_retry: int,
    sqlite_begin: str,
) -> RDBStorage:
    _refuse_a_registry(url)
    backend = _backend_name(url)
    if backend == "sqlite":
        database = url.removeprefix("sqlite:///")
        if url.startswith("sqlite:///") and database not in ("", ":memory:"):
            parent = Path(database).expanduser().parent
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise ConfigError(
                    f"search.storage={url} cannot be opened: cannot create directory "
                    f"{parent}: {error.strerror}"
                ) from error
    engine_kwargs: dict[str, Any] = {}
    if backend == "sqlite":
        # isolation_level=None: the driver issues no BEGIN of its own; _sqlite_begin does.
        engine_kwargs["connect_args"] = {"timeout": SQLITE_BUSY_TIMEOUT_S, "isolation_level": None}
    elif backend == "postgresql":
        engine_kwargs["pool_pre_ping"] = True
        if "connect_timeout" not in url:
            engine_kwargs["connect_args"] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    error: Exception | None = None
    for attempt in range(OPEN_ATTEMPTS):
        if backend == "sqlite":
            _prepare_sqlite_file(url)
        try:
            with warnings.catch_warnings():
                # Heartbeats are marked experimental; they are how a dead worker's
                # RUNNING trial gets failed and retried.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = RDBStorage(
                    url,
                    engine_kwargs=engine_kwargs or None,
                    heartbeat_interval=heartbeat_interval_s,
                    grace_period=grace_period_s,
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry),
                )
        except Exception as caught:  # SQLAlchemy/Optuna raise many kinds; all mean "unusable"
            error = caught
            if not _is_creation_race(caught) or attempt == OPEN_ATTEMPTS - 1:
                break
            time.sleep(random.uniform(0.05, 0.3) * (attempt + 1))
            continue
        if backend == "sqlite":
            event.listen(storage.engine, "connect", _sqlite_pragmas)
            event.listen(storage.engine, "begin", functools.partial(_sqlite_begin, sqlite_begin))
            storage.engine.dispose()  # reconnect with the pragmas
        return storage
    assert error is not None  # the loop returns or records why it could not
    message = missing_driver(url, error) or database_message(error)
    raise ConfigError(f"search.storage={_shown(url)} cannot be opened: {message}") from error


def _refuse_a_registry(url: str) -> None:
    """``ConfigError`` when ``url`` holds the plan registry's tables: Optuna would add its
    own to them (its ``alembic_version`` row clashing with the registry's)."""
    if _backend_name(url) == "sqlite":
        database = make_url(url).database
        if not database or database == ":memory:" or database.startswith("file:"):
            return
        tables = sqlite_tables(Path(database).expanduser())
    else:
        tables = _server_tables(url)
    if tables is not None and kind_of(tables) == REGISTRY:
        raise ConfigError(
            f"search.storage={_shown(url)} is invalid: it is a plan registry (tables plans, "
            "best_plans), not an Optuna study storage; give the study a database of its own "
            "(default: studies.sqlite beside the registry)"
        )


def _server_tables(url: str) -> set[str] | None:
    """The table names of a server database; None when it cannot be asked (RDBStorage
    then reports why in its own words)."""
    from sqlalchemy import create_engine, inspect

    try:
        engine = create_engine(url, connect_args=_connect_args(url))
    except Exception:  # a driver missing, a malformed URL: reported by the open itself
        return None
    try:
        with engine.connect() as connection:
            return set(inspect(connection).get_table_names())
    except Exception:  # unreachable, refused: the same
        return None
    finally:
        engine.dispose()


def _connect_args(url: str) -> dict[str, Any]:
    if _backend_name(url) == "postgresql" and "connect_timeout" not in url:
        return {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    return {}


def storage_url(storage: BaseStorage) -> str:
    """The URL to show for ``storage`` (a password is masked as ``***``)."""
    engine = getattr(storage, "engine", None)
    if engine is not None:
        return engine.url.render_as_string(hide_password=True)
    return type(storage).__name__


def is_server(url: str) -> bool:
    """Whether ``url`` names a database server (shared by hosts), not a local file."""
    return _backend_name(url) not in ("sqlite", "")


def _backend_name(url: str) -> str:
    try:
        return make_url(url).get_backend_name()
    except ArgumentError:
        return ""


def _shown(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _is_creation_race(error: Exception) -> bool:
    text = str(error).lower()
    return any(
        words in text
        for words in ("already exists", "database is locked", "duplicate key", "unique constraint")
    )


def _prepare_sqlite_file(url: str) -> None:
    """Put a new SQLite file in WAL before Optuna opens it.

    Switching the journal mode needs the database to itself; done on every
    connection (as the pragma hook does) it would collide with the other
    workers' transactions. WAL is a property of the file, so once is enough.
    """
    database = make_url(url).database
    if not database or database == ":memory:":
        return
    try:
        with sqlite3.connect(Path(database).expanduser(), timeout=SQLITE_BUSY_TIMEOUT_S) as db:
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error:
        pass  # RDBStorage reports the problem in its own words


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(statement: str, connection: Any) -> None:
    connection.exec_driver_sql(statement)
