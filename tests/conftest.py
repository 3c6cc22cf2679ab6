"""Shared fixtures: a throwaway PostgreSQL server (``tests/postgres_server.py``).

Tests that need it are marked ``@pytest.mark.postgres`` and take ``postgres_url``
(one database for the session) or ``fresh_postgres_url`` (a new empty database
per test). Without PostgreSQL binaries or the psycopg driver they skip locally,
but fail under CI (``CI`` set, as CI services do): a CI run must never pass by
silently skipping them. ``.ci/install-postgres`` installs Debian's server.

Every test runs with its own per-user data directory (``tuner.data_dir``), so
nothing a test writes by default lands in the real one, and tests that start
the CLI in a subprocess inherit it.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from postgres_server import PostgresServer, PostgresUnavailable

from tuner.data_dir import DATA_DIR_VARIABLE

_database_numbers = itertools.count(1)


@pytest.fixture(autouse=True)
def private_data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> Path:
    """The per-user data directory of this test: empty, never the real one."""
    path = tmp_path_factory.mktemp("data") / "flash-attention-tuner"
    monkeypatch.setenv(DATA_DIR_VARIABLE, str(path))
    return path


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> NoReturn:
    if in_ci():
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the whole session, stopped and removed at the end."""
    if importlib.util.find_spec("psycopg") is None:
        _unavailable("psycopg is not installed (pip install -e '.[postgres]')")
    try:
        server = PostgresServer.start()
    except PostgresUnavailable as e:
        _unavailable(str(e))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """``postgresql+psycopg://postgres@127.0.0.1:PORT/tuner``, shared by the session."""
    return postgres_server.create_database("tuner")


@pytest.fixture
def fresh_postgres_url(postgres_server: PostgresServer) -> str:
    """A new, empty database on the session's server, so tests cannot see each other's rows."""
    return postgres_server.create_database(f"test_{next(_database_numbers)}")
