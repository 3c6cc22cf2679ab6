"""Schema revisions: which ones this code knows, the check on open, and upgrading.

Policy (decided here, documented in the CLI help and the registry docstring):

* a new, empty database is created at the newest revision by a writer;
* a database at the newest revision opens;
* a database at an older known revision is refused, for readers and writers
  alike, with the upgrade command. Upgrading is an explicit step because the
  file is shared: an implicit upgrade by a tuning run would lock out deploy
  readers still running older code, without anyone having decided it;
* a database at a revision this code does not know (newer) is refused.

The check on open reads ``alembic_version`` only; the migration scripts are
loaded by ``upgrade()`` alone, so a read-only open stays cheap.
"""

from __future__ import annotations

import sqlite3
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from db.storage import BEGIN_MODE_OPTION, FOREIGN_KEYS_OFF_OPTION, registry_error
from tuner.database_kinds import STUDY_STORAGE, kind_of
from tuner.errors import RegistryError

if TYPE_CHECKING:
    from alembic.config import Config

#: Every revision in ``db/migrations/versions``, oldest first (a test checks it).
KNOWN_REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009")
HEAD_REVISION = KNOWN_REVISIONS[-1]
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "alembic_version"
# PostgreSQL advisory lock key serialising upgrades (any fixed 64-bit number
# unlikely to be used by another application on the same server).
PG_UPGRADE_LOCK_KEY = 0x66612D74756E6572  # "fa-tuner"


class _Empty:
    """No tables at all: a database nobody has created a registry in yet."""


class _Foreign:
    """Tables, but no version table: some other application's database."""


class _Study:
    """An Optuna study storage: it has an ``alembic_version`` too, of Optuna's revisions."""


EMPTY = _Empty()
FOREIGN = _Foreign()
STUDY = _Study()
SchemaState = str | _Empty | _Foreign | _Study


def upgrade_command(label: str) -> str:
    return f"python -m db upgrade --url {label}"


def alembic_config() -> Config:
    """Alembic configuration pointing at the packaged migrations, whatever the cwd."""
    # Imported here: Alembic costs ~150 ms to import and only upgrades need it.
    from alembic.config import Config

    config = Config()
    # ConfigParser interpolates '%'; a path containing one must be escaped.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return config


def read_state(connection: Connection) -> SchemaState:
    names = inspect(connection).get_table_names()
    if kind_of(names) == STUDY_STORAGE:
        return STUDY
    if VERSION_TABLE not in names:
        return FOREIGN if names else EMPTY
    revisions = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars()
    found = list(revisions)
    if len(found) != 1:
        return FOREIGN
    return str(found[0])


def _quick_revision(connection: Connection) -> str | None:
    """The revision by one SELECT (the usual case, and the cold-open budget is 5 ms);
    None when that does not work and the full inspection must decide."""
    try:
        with connection.begin():
            # exec_driver_sql: nothing to compile, the cheapest statement SQLAlchemy runs.
            found = list(
                connection.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalars()
            )
    except SQLAlchemyError:
        # No version table, or not a database at all: read_state tells which.
        return None
    return str(found[0]) if len(found) == 1 else None


def refusal(state: SchemaState, label: str) -> RegistryError:
    """Why a database at ``state`` cannot be used by this code, with the fix."""
    fix = upgrade_command(label)
    if state is EMPTY:
        return RegistryError(f"registry {label} is empty (no schema yet); create it with `{fix}`")
    if state is FOREIGN:
        return RegistryError(
            f"{label} is a database but not a plan registry (no {VERSION_TABLE} revision)"
        )
    if state is STUDY:
        return RegistryError(
            f"{label} is an Optuna study storage (tables studies, trials), not a plan registry: "
            "give the registry its own database (registry.url, --url; plans.sqlite by default) "
            "and leave this one to the study (search.storage)"
        )
    if state in KNOWN_REVISIONS:
        return RegistryError(
            f"registry {label} has schema revision {state}, older than this code's "
            f"{HEAD_REVISION}; upgrade it with `{fix}`"
        )
    return RegistryError(
        f"registry {label} has schema revision {state!r}, unknown to this code (newest known "
        f"{HEAD_REVISION}): it was written by a newer flash-attention-tuner; install that "
        f"version, then `{fix}` applies any pending migration"
    )


def verify(engine: Engine, label: str, *, create: bool) -> None:
    """Refuse a database this code cannot use; create an empty one when ``create``."""
    try:
        with engine.connect() as connection:
            state = _quick_revision(connection)
            if state != HEAD_REVISION:
                # The tables decide what a database that is not at HEAD is: empty, older,
                # or not a registry at all (an Optuna study storage has a revision too).
                with connection.begin():
                    state = read_state(connection)
    except SQLAlchemyError as e:
        raise registry_error(e, label) from e
    if state == HEAD_REVISION:
        return
    if state is EMPTY and create:
        upgrade(engine, label)
        return
    raise refusal(state, label)


def upgrade(engine: Engine, label: str) -> tuple[str | None, str]:
    """Bring the database to the newest revision; returns (revision before, after).

    Runs inside one write transaction (``BEGIN IMMEDIATE`` on SQLite, a
    transaction-level advisory lock on PostgreSQL, whose DDL is transactional):
    two processes upgrading at once serialise, and the second finds nothing to do.
    SQLite's batch migrations recreate tables that others reference, so foreign
    keys are off for that transaction and checked by ``foreign_key_check``
    before it commits.
    """
    from alembic.util import CommandError

    options = {BEGIN_MODE_OPTION: "IMMEDIATE", FOREIGN_KEYS_OFF_OPTION: True}
    try:
        with engine.connect() as connection:
            connection = connection.execution_options(**options)
            try:
                with connection.begin():
                    _lock_out_other_upgrades(connection)
                    before = read_state(connection)
                    if before is FOREIGN or before is STUDY or (
                        isinstance(before, str) and before not in KNOWN_REVISIONS
                    ):
                        raise refusal(before, label)
                    if before != HEAD_REVISION:
                        _run_migrations(connection)
                        _check_foreign_keys(connection, label)
            finally:
                _restore_foreign_keys(connection)
    except SQLAlchemyError as e:
        raise registry_error(e, label) from e
    except CommandError as e:
        raise RegistryError(f"cannot upgrade registry {label}: {e}") from e
    return (before if isinstance(before, str) else None), HEAD_REVISION


def _lock_out_other_upgrades(connection: Connection) -> None:
    """On PostgreSQL, wait for any other upgrade to commit before reading the revision.

    Without it, writers opening an empty database at once would all see it
    empty and race to create the same tables. Under READ COMMITTED the state
    read after the lock sees what the previous holder committed.
    """
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_UPGRADE_LOCK_KEY})


def _run_migrations(connection: Connection) -> None:
    from alembic import command

    config = alembic_config()
    # env.py runs on this connection, inside the transaction opened above.
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


def _check_foreign_keys(connection: Connection, label: str) -> None:
    if connection.dialect.name != "sqlite":
        return
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if broken:
        raise RegistryError(
            f"upgrading registry {label} would break {len(broken)} foreign key(s); nothing changed"
        )


def _restore_foreign_keys(connection: Connection) -> None:
    """Turn foreign keys back on for the pooled connection the upgrade used."""
    if connection.dialect.name != "sqlite":
        return
    try:
        raw = connection.connection.dbapi_connection
        assert raw is not None
        # Outside any transaction now (the driver is in autocommit), so it takes effect.
        raw.execute("PRAGMA foreign_keys = ON")
    except (sqlite3.Error, SQLAlchemyError, AssertionError):
        # A connection we cannot fix must not go back to the pool.
        with suppress(SQLAlchemyError):
            connection.invalidate()
