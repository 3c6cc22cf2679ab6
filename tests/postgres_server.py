"""A throwaway PostgreSQL server for tests, run from Debian's binaries.

    with PostgresServer.start() as server:      # raises PostgresUnavailable without binaries
        url = server.create_database("registry")  # postgresql+psycopg://postgres@127.0.0.1:PORT/registry

The server lives in a temporary directory (data, log and Unix socket), listens
on 127.0.0.1 only, on a free port, with trust authentication except for one
password role (``PASSWORD_ROLE``) kept for testing bad credentials. It is built
for speed, not durability: fsync is off, since the data dies with the test run.

``initdb`` and the server refuse to run as root, so as root every server-side
command runs through ``runuser`` as an unprivileged system user (``postgres``,
which Debian's package creates; created here when missing) that owns the
temporary directory. Client commands (createdb, psql) run as whoever we are.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

DEBIAN_GLOB = "/usr/lib/postgresql/*/bin"
SERVER_USER = "postgres"  # the OS user the server runs as when we are root
SUPERUSER = "postgres"  # the database superuser initdb creates
PASSWORD_ROLE = "tuner_password"
PASSWORD = "right-password"
LOOPBACK = "127.0.0.1"  # the only address these tests may use
PREFIX = "tuner-postgres-"
OWNER_FILE = "owner.pid"  # the pid of the process that started the server
START_ATTEMPTS = 3  # a free port found by bind() can be taken before the server binds it
COMMAND_TIMEOUT_S = 120


class PostgresUnavailable(Exception):
    """No PostgreSQL binaries on this machine (a reason to skip, outside CI)."""


class PostgresStartError(RuntimeError):
    """The binaries exist but the server could not be set up (always a failure)."""


def find_bindir() -> Path | None:
    """The newest Debian PostgreSQL ``bin`` with both pg_ctl and initdb, else one on PATH."""
    candidates = []
    for bindir in Path("/").glob(DEBIAN_GLOB.lstrip("/")):
        version = re.fullmatch(r"\d+(?:\.\d+)*", bindir.parent.name)
        if version and all((bindir / tool).is_file() for tool in ("pg_ctl", "initdb")):
            # Numeric, not lexical: 9.6 is older than 15.
            candidates.append((tuple(int(p) for p in bindir.parent.name.split(".")), bindir))
    if candidates:
        return max(candidates)[1]
    # Other distributions put the server binaries on PATH.
    pg_ctl, initdb = shutil.which("pg_ctl"), shutil.which("initdb")
    if pg_ctl and initdb and Path(pg_ctl).parent == Path(initdb).parent:
        return Path(pg_ctl).parent
    return None


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def closed_loopback_port() -> int:
    """A port nothing listens on (as of now): for testing an unreachable server."""
    return free_loopback_port()


@dataclass
class PostgresServer:
    bindir: Path
    base: Path  # temporary directory: data/, server.log, socket
    port: int
    server_user: str | None  # None: server commands run as the current user

    @property
    def data_dir(self) -> Path:
        return self.base / "data"

    @property
    def log_file(self) -> Path:
        return self.base / "server.log"

    @property
    def socket_dir(self) -> Path:
        return self.base / "socket"

    def url(
        self, database: str = "postgres", *, user: str = SUPERUSER, password: str | None = None
    ) -> str:
        auth = user if password is None else f"{user}:{password}"
        return f"postgresql+psycopg://{auth}@{LOOPBACK}:{self.port}/{database}"

    # -- life cycle ----------------------------------------------------------

    @classmethod
    def start(cls) -> PostgresServer:
        """initdb + pg_ctl start in a fresh temporary directory; removed again on failure."""
        bindir = find_bindir()
        if bindir is None:
            raise PostgresUnavailable(
                f"no PostgreSQL server binaries (pg_ctl, initdb) in {DEBIAN_GLOB} or on PATH; "
                "install them with .ci/install-postgres (Debian's postgresql package)"
            )
        server_user = _server_user()
        _remove_orphans(bindir, server_user)
        base = Path(tempfile.mkdtemp(prefix=PREFIX))
        (base / OWNER_FILE).write_text(str(os.getpid()))
        server = cls(bindir, base, 0, server_user)
        try:
            server._init()
            server._start_on_a_free_port()
            server._psql(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'")
        except BaseException:
            server.stop()
            raise
        return server

    def stop(self) -> None:
        """Stop the server (fast shutdown: rolls back open sessions) and remove the directory."""
        try:
            if (self.data_dir / "postmaster.pid").exists():
                stop = [str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-w"]
                if self._run_server([*stop, "-m", "fast"], check=False).returncode != 0:
                    # A server that will not stop must not outlive the test run.
                    self._run_server([*stop, "-m", "immediate"], check=False)
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # -- databases -----------------------------------------------------------

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL (superuser, no password)."""
        self._client([str(self.bindir / "createdb"), *self._client_target(), "-O", SUPERUSER, name])
        # The password role may use every database (for the bad-credentials test).
        self._psql(f'GRANT ALL ON DATABASE "{name}" TO {PASSWORD_ROLE}')
        return self.url(name)

    # -- internals -----------------------------------------------------------

    def _init(self) -> None:
        self.socket_dir.mkdir()
        if self.server_user is not None:
            entry = pwd.getpwnam(self.server_user)
            for path in (self.base, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            # mkdtemp makes the directory 0700 for us; the server user must reach it.
            probe = ["test", "-w", str(self.base)]
            if self._run_server(probe, check=False).returncode != 0:
                raise PostgresStartError(
                    f"user {self.server_user} cannot write {self.base}; set TMPDIR to a "
                    "directory every user can reach"
                )
        self._run_server(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                # C collation: text ordering identical to SQLite's byte order.
                "--no-locale",
                # The cluster dies with the test run; skipping fsync saves seconds.
                "--no-sync",
            ]
        )
        # Trust for everyone on loopback and the socket, except the password role,
        # which must prove itself (so a wrong password can be tested).
        (self.data_dir / "pg_hba.conf").write_text(
            "local all all trust\n"
            f"host all {PASSWORD_ROLE} {LOOPBACK}/32 scram-sha-256\n"
            f"host all all {LOOPBACK}/32 trust\n"
        )

    def _start_on_a_free_port(self) -> None:
        failures = []
        for _ in range(START_ATTEMPTS):
            self.port = free_loopback_port()
            options = " ".join(
                [
                    f"-c listen_addresses={LOOPBACK}",
                    f"-c port={self.port}",
                    f"-c unix_socket_directories={self.socket_dir}",
                    "-c fsync=off",
                    "-c synchronous_commit=off",
                    "-c full_page_writes=off",
                ]
            )
            start = [str(self.bindir / "pg_ctl"), "start", "-D", str(self.data_dir)]
            result = self._run_server(
                [*start, "-l", str(self.log_file), "-w", "-t", "60", "-o", options], check=False
            )
            if result.returncode == 0:
                return
            failures.append(self._log_tail())
        raise PostgresStartError(
            f"PostgreSQL did not start after {START_ATTEMPTS} attempts; last log: {failures[-1]}"
        )

    def _log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-5:]) or "(empty log)"

    def _client_target(self) -> list[str]:
        # Over the socket in our own directory: no TCP needed for setup.
        return ["-h", str(self.socket_dir), "-p", str(self.port), "-U", SUPERUSER]

    def _psql(self, sql: str) -> None:
        self._client(
            [
                str(self.bindir / "psql"),
                *self._client_target(),
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                "postgres",
                "-c",
                sql,
            ]
        )

    def _client(self, command: Sequence[str]) -> None:
        _run(command, cwd=self.base)

    def _run_server(self, command: Sequence[str], *, check: bool = True) -> _Result:
        if self.server_user is not None:
            command = ["runuser", "-u", self.server_user, "--", *command]
        return _run(command, cwd=self.base, check=check)


@dataclass(frozen=True)
class _Result:
    returncode: int
    output: str


def _run(command: Sequence[str], *, cwd: Path, check: bool = True) -> _Result:
    try:
        done = subprocess.run(
            list(command),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise PostgresStartError(f"{command[0]} took over {COMMAND_TIMEOUT_S} s") from e
    output = (done.stdout + done.stderr).strip()
    if check and done.returncode != 0:
        raise PostgresStartError(
            f"{' '.join(command)} failed ({done.returncode}): {' | '.join(output.splitlines())}"
        )
    return _Result(done.returncode, output)


def _remove_orphans(bindir: Path, server_user: str | None) -> None:
    """Stop and remove servers left by test runs that died without teardown.

    A run killed by SIGTERM/SIGKILL (a CI timeout) never reaches the fixture's
    finaliser, and pg_ctl's server is a daemon that outlives it. Only our own
    directories (prefix and owner file) whose owner process is gone are touched.
    """
    for base in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            owner = int((base / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being set up
        if _alive(owner):
            continue
        # Best effort: a leftover must not stop this run.
        with contextlib.suppress(OSError, PostgresStartError):
            PostgresServer(bindir, base, 0, server_user).stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _server_user() -> str | None:
    """Who runs initdb and the server: ourselves, or as root an unprivileged system user."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SERVER_USER)
    except KeyError:
        # Debian's postgresql package creates this user; a bare machine may lack it.
        _run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                SERVER_USER,
            ],
            cwd=Path("/"),
        )
    return SERVER_USER
