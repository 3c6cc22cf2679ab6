"""One line for a database error, for the registry and the study storage alike.

SQLAlchemy appends ``[SQL: ...]``, ``[parameters: ...]`` and
``(Background on this error at: https://sqlalche.me/...)`` to its messages and
wraps the driver's exception; a one-line error keeps only the driver's words.
A URL whose driver is not installed names the extra that installs it.
"""

from __future__ import annotations

import re

from sqlalchemy.exc import DBAPIError

#: SQLAlchemy's additions to a driver's message
_TAILS = re.compile(
    r"\s*\[SQL: .*?\](?=\s*(\[|\(Background|$))"
    r"|\s*\[parameters: .*?\](?=\s*(\[|\(Background|$))"
    r"|\s*\(Background on this error at: [^)]*\)",
    re.DOTALL,
)
#: the driver modules of the URLs the project supports, and the extra that installs each
_DRIVER_EXTRAS = {"psycopg": "postgres", "psycopg2": "postgres", "asyncpg": "postgres"}


def database_message(error: BaseException) -> str:
    """The driver's own message on one line, without SQLAlchemy's SQL and link."""
    source = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    text = _TAILS.sub("", str(source))
    # A driver error wrapped without .orig still carries the "(sqlite3.X) " prefix.
    text = re.sub(r"^\((?:[\w.]+)\)\s*", "", text.strip())
    return " ".join(text.split()) or type(source).__name__


def missing_driver(url: str, error: BaseException) -> str | None:
    """``no driver ... (pip install 'flash-attention-tuner[postgres]')`` when ``error`` is a
    missing driver module for ``url``; None otherwise."""
    name = getattr(error, "name", None) if isinstance(error, ImportError) else None
    backend = url.split(":", 1)[0].split("+", 1)[0]
    if name is None:
        lowered = str(error).lower()
        if not (backend == "postgresql" and ("import" in lowered or "module" in lowered)):
            return None
        name = "psycopg"
    extra = _DRIVER_EXTRAS.get(name.split(".")[0])
    if extra is None and backend == "postgresql":
        extra = "postgres"
    install = f"pip install 'flash-attention-tuner[{extra}]'" if extra else f"pip install {name}"
    return f"the database driver {name!r} for {backend} URLs is not installed ({install})"
