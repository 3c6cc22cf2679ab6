"""Whose database a file or server holds: the plan registry's or an Optuna study storage's.

Both keep an ``alembic_version`` table, so a version alone cannot tell them
apart: pointed at a registry, Optuna would add its tables to it (after a
message about Optuna versions), and the registry would take Optuna's revision
for one of a newer tuner. The tables they own can: each store recognises the
other's and refuses it in one line (``db.schema``, ``tuner.study_storage``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from contextlib import closing
from pathlib import Path
from urllib.parse import quote

#: tables only the plan registry has (``db.models``)
REGISTRY_TABLES = frozenset({"plans", "best_plans", "problems", "environments"})
#: tables only an Optuna RDB storage has
STUDY_TABLES = frozenset({"studies", "trials", "version_info", "trial_heartbeats"})

REGISTRY = "a plan registry"
STUDY_STORAGE = "an Optuna study storage"


def kind_of(tables: Iterable[str]) -> str:
    """``REGISTRY``, ``STUDY_STORAGE`` or "" (neither, or empty) for a database's table names."""
    names = set(tables)
    if names >= {"plans", "best_plans"} and not names & {"studies", "trials"}:
        return REGISTRY
    if names >= {"studies", "trials"} and not names & {"plans", "best_plans"}:
        return STUDY_STORAGE
    return ""


def sqlite_tables(path: Path) -> set[str] | None:
    """The table names of the SQLite file ``path``; None when it is missing or unreadable.

    Read with ``immutable=1``: nothing is locked, and no ``-wal``/``-shm`` is made
    beside the file. A table created but not yet checkpointed out of another
    process's WAL may be missed; the stores create theirs and close before
    anyone points the other at the file.
    """
    if not path.is_file():
        return None
    uri = f"file:{quote(str(path.resolve()))}?mode=ro&immutable=1"
    try:
        with closing(sqlite3.connect(uri, uri=True)) as connection:
            rows = connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            return {str(row[0]) for row in rows}
    except sqlite3.Error:
        return None
