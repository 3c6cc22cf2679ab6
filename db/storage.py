"""Engines and transactions for the registry: where the database lives and how it is opened.

SQLite (the default) gets:

* WAL journal (readers never block the writer and vice versa) and
  ``synchronous=NORMAL`` (atomic and consistent after a crash; the last
  commits may be lost on power failure, acceptable for re-runnable tuning);
* a 30 s busy timeout, so concurrent writers queue instead of failing;
* ``foreign_keys=ON`` on every connection;
* transaction control taken away from the sqlite3 driver (whose legacy mode
  does not BEGIN before SELECTs) and done by SQLAlchemy's ``begin`` event, as
  SQLAlchemy 2.1's SQLite dialect docs show. Write sessions emit
  ``BEGIN IMMEDIATE``: they take the write lock before their first read, so
  "keep the better plan" is decided on data no other writer can change, and a
  lock conflict waits in the busy handler instead of failing mid-transaction;
* read-only handles opened through a ``file:...?mode=ro`` URI, so SQLite
  itself refuses writes and never creates a missing file.

PostgreSQL (``postgresql+psycopg://user@host:port/db``, the ``postgres`` extra) gets:

* a connect timeout (``CONNECT_TIMEOUT_S`` unless the URL sets ``connect_timeout``),
  so an unreachable server is a quick one-line error, not a hang;
* the server's default READ COMMITTED isolation for writes: ``db.writes`` locks
  the best pointer with ``SELECT ... FOR UPDATE`` before comparing, and inserts
  racing on a unique key resolve through a savepoint. Deadlocks and
  serialization failures (possible when two imports touch the same problems in
  different orders) leave as ``WriteConflict``, and ``PlanRegistry`` retries the
  whole write transaction;
* read-only handles whose every transaction is ``READ ONLY``
  (``postgresql_readonly``), so the server itself refuses writes;
* connection errors (unreachable, bad credentials, missing database) as one
  line naming host:port and database.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import quote

# Imported up front: SQLAlchemy loads a dialect on the first create_engine for
# its URL (35 ms for SQLite); paying that at import keeps the first open cheap.
import sqlalchemy.dialects.sqlite  # noqa: F401
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session

from tuner.database_errors import database_message, missing_driver
from tuner.errors import RegistryError

BUSY_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5  # libpq's connect_timeout, whole seconds

# Connection execution options read by the ``begin`` hook.
BEGIN_MODE_OPTION = "registry_sqlite_begin"  # "DEFERRED" (reads) or "IMMEDIATE" (writes)
FOREIGN_KEYS_OFF_OPTION = "registry_sqlite_foreign_keys_off"  # migrations only

_NOT_A_DATABASE = ("file is not a database", "malformed", "not a database", "corrupt")

# SQLSTATEs after which the whole write transaction can simply run again.
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected

# libpq reports connection failures as text only (no SQLSTATE reaches psycopg).
_PG_MISSING_DATABASE = re.compile(r'database "[^"]*" does not exist')
_PG_BAD_CREDENTIALS = (
    "password authentication failed",
    "no password supplied",
    "authentication failed",
    "role ",  # role "x" does not exist
    "pg_hba.conf",
)
_PG_UNREACHABLE = (
    "connection refused",
    "could not connect",
    "timeout expired",
    "could not translate host name",
    "no route to host",
    "network is unreachable",
    "server closed the connection",
)


class WriteConflict(RegistryError):
    """A write transaction lost a deadlock or serialization conflict; running it again is safe."""


# Parsed once at import: compiles SQLAlchemy's URL pattern (about 1 ms, done
# lazily otherwise) outside the cold-open path.
_DEFAULT_PARSED = make_url("sqlite://")


def parse_url(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError as e:
        raise RegistryError(f"invalid registry URL {url!r}: {one_line(e)}") from e


def describe(url: URL) -> str:
    """The URL as safe to print (password hidden)."""
    return url.render_as_string(hide_password=True)


def one_line(error: BaseException) -> str:
    """The driver's own message, on one line (SQLAlchemy appends SQL and links)."""
    return database_message(error)


def is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL; None for an in-memory database."""
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


#: the files SQLite keeps beside a database in WAL mode while it is open
WAL_SIDECARS = ("-wal", "-shm")


class SidecarTidy:
    """Removes the ``-wal``/``-shm`` files a handle made beside a SQLite file, when it closes.

    SQLite deletes them when the last connection to a WAL database closes, but
    only a connection that may write can: a read-only handle (``mode=ro``: every
    ``python -m db`` query, the tuner's check of an existing registry) leaves
    them behind, also beside a file it refused as corrupt. After such a handle
    is disposed, one plain connection is opened and closed, so that SQLite
    itself, as the last connection, checkpoints and removes them; it does
    nothing while any other process has the database open, and nothing to files
    that were there before this handle opened.
    """

    def __init__(self, url: URL) -> None:
        path = sqlite_file(url) if is_sqlite(url) else None
        self._path = path
        self._existed = frozenset(
            s for s in WAL_SIDECARS if path is not None and _sidecar(path, s).exists()
        )

    def __call__(self) -> None:
        path = self._path
        if path is None:
            return
        made = [
            s for s in WAL_SIDECARS if s not in self._existed and _sidecar(path, s).exists()
        ]
        if not made or not path.is_file():
            return
        if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)):
            return  # read-only here: SQLite could not remove them either
        with suppress(sqlite3.Error):
            connection = sqlite3.connect(path, timeout=1.0)
            try:
                # Opening the WAL is what lets the closing connection clean it up; on a
                # file that is not a database this fails, and the close still tidies.
                with suppress(sqlite3.Error):
                    connection.execute("PRAGMA journal_mode").fetchone()
            finally:
                connection.close()


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def create_registry_engine(url: URL, *, readonly: bool) -> Engine:
    """An engine for ``url``, checking the file system first for SQLite."""
    try:
        if not is_sqlite(url):
            return _server_engine(url, readonly=readonly)
        path = sqlite_file(url)
        if readonly and path is not None:
            engine = _sqlite_readonly_engine(url, path)
        else:
            if path is not None:
                _prepare_writable_file(path)
            engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_S})
    except NoSuchModuleError as e:
        raise RegistryError(
            f"no database driver for {describe(url)} (for PostgreSQL install the 'postgres' extra)"
        ) from e
    except ImportError as e:
        driver = missing_driver(describe(url), e)
        raise RegistryError(
            f"cannot use registry URL {describe(url)}: {driver or one_line(e)}"
        ) from e
    except ArgumentError as e:
        raise RegistryError(f"cannot use registry URL {describe(url)}: {one_line(e)}") from e
    _install_sqlite_hooks(engine, writer=not readonly)
    return engine


def _server_engine(url: URL, *, readonly: bool) -> Engine:
    """An engine for a database server (PostgreSQL; other servers get SQLAlchemy's defaults)."""
    if url.get_backend_name() != "postgresql":
        return create_engine(url, pool_pre_ping=True)
    connect_args: dict[str, object] = {}
    if "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = CONNECT_TIMEOUT_S
    options: dict[str, object] = {}
    if readonly:
        # Every transaction of this engine begins READ ONLY: the server, not
        # just this handle, refuses writes.
        options["postgresql_readonly"] = True
    return create_engine(
        url, pool_pre_ping=True, connect_args=connect_args, execution_options=options
    )


def check_creatable(path: Path) -> None:
    """``RegistryError`` unless ``path`` (missing) could be created, creating nothing."""
    if path.is_dir():
        raise RegistryError(f"registry path {path} is a directory, not a database file")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise RegistryError(
            f"cannot create directory {path.parent} for the plan registry: "
            f"{ancestor} is not a directory"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RegistryError(f"cannot create the plan registry {path}: {ancestor} is not writable")


def check_writable_file(path: Path) -> None:
    """``RegistryError`` unless the existing registry file ``path`` can be written."""
    if path.is_dir():
        raise RegistryError(f"registry path {path} is a directory, not a database file")
    if not os.access(path, os.W_OK):
        raise RegistryError(f"{path} is not writable; open the registry read-only instead")


def _prepare_writable_file(path: Path) -> None:
    if path.is_dir():
        raise RegistryError(f"registry path {path} is a directory, not a database file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RegistryError(
            f"cannot create directory {path.parent} for the plan registry: {e.strerror or e}"
        ) from e
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        raise RegistryError(f"{target} is not writable; open the registry read-only instead")


def _sqlite_readonly_engine(url: URL, path: Path) -> Engine:
    if not path.is_file():
        where = "directory" if path.is_dir() else "file"
        missing = "is a directory" if path.is_dir() else "does not exist"
        raise RegistryError(
            f"no plan registry at {path}: the {where} {missing} (a read-only open creates nothing)"
        )
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"

    def connect() -> sqlite3.Connection:
        return sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)

    # The creator bypasses URL parsing of the path, so odd characters need no escaping rules.
    return create_engine("sqlite://", creator=connect)


def _install_sqlite_hooks(engine: Engine, *, writer: bool) -> None:
    if engine.dialect.name != "sqlite":
        return

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        # None = driver autocommit: it never emits BEGIN; our "begin" hook does.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if writer:
                # journal_mode is persistent in the file; readers inherit WAL from it.
                cursor.execute("PRAGMA journal_mode = WAL")
                cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        options = connection.get_execution_options()
        if options.get(FOREIGN_KEYS_OFF_OPTION):
            # Must precede BEGIN: the pragma is a no-op inside a transaction.
            connection.exec_driver_sql("PRAGMA foreign_keys = OFF")
        connection.exec_driver_sql(f"BEGIN {options.get(BEGIN_MODE_OPTION, 'DEFERRED')}")


def is_retryable(error: BaseException) -> bool:
    """A deadlock or serialization failure: the transaction was rolled back and may rerun."""
    source = error.orig if isinstance(error, DBAPIError) else error
    return getattr(source, "sqlstate", None) in _RETRYABLE_SQLSTATES


def registry_error(error: BaseException, label: str) -> RegistryError:
    """One clear line for a database error; the caller chains it with ``from``."""
    detail = one_line(error)
    lowered = detail.lower()
    if is_retryable(error):
        return WriteConflict(f"registry {label}: write conflict with another writer ({detail})")
    if label.startswith("postgresql"):
        connection_error = _postgres_connection_error(detail, label)
        if connection_error is not None:
            return connection_error
    if any(marker in lowered for marker in _NOT_A_DATABASE):
        return RegistryError(f"{label} is not a readable plan registry database ({detail})")
    if "database is locked" in lowered:
        return RegistryError(
            f"registry {label} stayed locked by another writer for over "
            f"{BUSY_TIMEOUT_S:.0f} s ({detail})"
        )
    if "readonly database" in lowered or "read-only" in lowered:
        return RegistryError(f"registry {label} is read-only here ({detail})")
    return RegistryError(f"registry {label}: {detail}")


def _postgres_connection_error(detail: str, label: str) -> RegistryError | None:
    """Why a PostgreSQL connection failed, naming host:port and database; None if it did not."""
    lowered = detail.lower()
    markers = ("connection failed", "connection to server", "could not connect")
    if not any(marker in lowered for marker in markers):
        return None
    try:
        url = make_url(label)
    except ArgumentError:
        return None
    host, port = url.host or "localhost", url.port or 5432
    place = f"{host}:{port}"
    database = url.database or url.username or "(default)"
    # libpq's text says "connection to server at "h", port p failed: REASON"; keep REASON.
    reason = detail.rsplit("failed:", 1)[-1].replace("FATAL:", "").strip() or detail
    if _PG_MISSING_DATABASE.search(lowered):
        return RegistryError(
            f"database {database!r} does not exist on the PostgreSQL server at {place}; "
            f"create it (createdb -h {host} -p {port} {database}) or fix the URL"
        )
    if any(marker in lowered for marker in _PG_BAD_CREDENTIALS):
        return RegistryError(
            f"the PostgreSQL server at {place} refused user {url.username!r} for database "
            f"{database!r}: {reason}; check the user and password in the URL"
        )
    if any(marker in lowered for marker in _PG_UNREACHABLE):
        return RegistryError(
            f"cannot reach the PostgreSQL server at {place} (database {database!r}): {reason}"
        )
    return RegistryError(f"cannot connect to {place}/{database} for registry {label}: {reason}")


@contextmanager
def session_scope(engine: Engine, label: str, *, write: bool) -> Iterator[Session]:
    """A session that commits on success and rolls back on any error.

    Database errors leave as ``RegistryError`` chained to their cause.
    """
    options = {BEGIN_MODE_OPTION: "IMMEDIATE" if write else "DEFERRED"}
    session = Session(engine, execution_options=options, expire_on_commit=False)
    try:
        yield session
        session.commit()
    except SQLAlchemyError as e:
        _rollback_quietly(session)
        raise registry_error(e, label) from e
    except BaseException:
        _rollback_quietly(session)
        raise
    finally:
        session.close()


@contextmanager
def read_scope(engine: Engine, label: str) -> Iterator[Connection]:
    """A connection in one read transaction (one consistent snapshot).

    Reads use a Core connection, not a Session: they run text statements only
    (``db.reads``), and skipping the ORM session keeps the deploy-time lookup cheap.
    """
    try:
        with engine.connect() as connection, connection.begin():
            yield connection
    except SQLAlchemyError as e:
        raise registry_error(e, label) from e


def _rollback_quietly(session: Session) -> None:
    # The error being raised is the one worth reporting; a failed rollback on a
    # broken connection would only hide it.
    with suppress(SQLAlchemyError):
        session.rollback()
