"""Database errors as one line: the driver's words, no SQLAlchemy tails, the extra to install."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from db import PlanRegistry
from tuner.database_errors import database_message, missing_driver
from tuner.errors import ConfigError, RegistryError
from tuner.study_storage import open_storage


def test_sqlalchemy_s_sql_and_link_are_dropped() -> None:
    wrapped = OperationalError(
        'PRAGMA main.table_info("studies")', {}, sqlite3.DatabaseError("file is not a database")
    )
    assert "[SQL:" in str(wrapped) and "sqlalche.me" in str(wrapped)
    assert database_message(wrapped) == "file is not a database"
    text = RuntimeError(
        "(sqlite3.DatabaseError) file is not a database\n[SQL: SELECT 1]\n"
        "(Background on this error at: https://sqlalche.me/e/21/4xp6)"
    )
    assert database_message(text) == "file is not a database"


def test_a_study_storage_that_is_not_a_database_is_one_clean_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.sqlite"
    path.write_text("garbage " * 200)
    with pytest.raises(ConfigError) as caught:
        open_storage(f"sqlite:///{path}")
    message = str(caught.value)
    assert message.endswith("cannot be opened: file is not a database"), message
    assert "[SQL" not in message and "Background" not in message


def test_a_missing_postgres_driver_names_the_extra() -> None:
    error = ModuleNotFoundError("No module named 'psycopg'", name="psycopg")
    line = missing_driver("postgresql+psycopg://u@h/db", error)
    assert line is not None and "pip install 'flash-attention-tuner[postgres]'" in line
    # Optuna says it in its own words, without the module's name.
    optuna_words = ImportError("Failed to import DB access module for the specified storage URL.")
    assert "[postgres]" in (missing_driver("postgresql://u@h/db", optuna_words) or "")
    assert missing_driver("sqlite:///x", RuntimeError("boom")) is None


def test_the_registry_and_the_study_name_the_postgres_extra(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_psycopg(name, *args, **kwargs):
        if name.split(".")[0] == "psycopg":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psycopg)
    with pytest.raises(RegistryError, match=r"flash-attention-tuner\[postgres\]"):
        PlanRegistry.open("postgresql+psycopg://u@127.0.0.1:1/db")
    with pytest.raises(ConfigError, match=r"flash-attention-tuner\[postgres\]"):
        open_storage("postgresql+psycopg://u@127.0.0.1:1/db")
