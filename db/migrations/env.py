"""Alembic environment of the plan registry.

The registry runs migrations programmatically on its own connection, inside a
write transaction it has already begun (``db.schema.upgrade``), and passes that
connection in ``config.attributes["connection"]``. Run by hand through the
alembic CLI, the URL comes from ``-x url=...`` or the ini file, and the
connection is opened through the registry's own engine factory so that the
same SQLite settings apply.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from db.models import Base

target_metadata = Base.metadata


def _configure_and_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite has almost no ALTER TABLE: batch mode recreates the table.
        render_as_batch=True,
    )
    # Inside the caller's transaction this is a no-op (Alembic detects it).
    with context.begin_transaction():
        context.run_migrations()


def _run_from_url() -> None:
    from db import storage

    url_text = context.get_x_argument(as_dictionary=True).get("url") or (
        context.config.get_main_option("sqlalchemy.url")
    )
    if not url_text:
        raise RuntimeError("no database URL: pass -x url=... to alembic")
    url = storage.parse_url(url_text)
    engine = storage.create_registry_engine(url, readonly=False)
    try:
        with engine.connect() as connection, connection.begin():
            _configure_and_run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported for the plan registry")

shared_connection = context.config.attributes.get("connection")
if shared_connection is not None:
    _configure_and_run(shared_connection)
else:
    _run_from_url()
