"""Recreate ``registry_0001.sqlite``: a registry frozen at schema revision 0001.

Kept only to document how the committed file was made; the tests use the
committed file, never this script (a frozen file must not change with the
code). Run from the repository root:

    .venv/bin/python tests/data/make_registry_0001.py
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import create_engine, text

from db.schema import alembic_config

TARGET = Path(__file__).with_name("registry_0001.sqlite")

# Two environments, two problems, three plans (one predicted), two best pointers.
ROWS = """
INSERT INTO environments VALUES (1, 'NVIDIA H200', '9.0', 132, '570.86', '12.8', '12.8.61');
INSERT INTO environments VALUES (2, 'model', '9.0', 132, '', '', '');
INSERT INTO problems VALUES (1, 4096, 128, 1, 1, 0, 'float32');
INSERT INTO problems VALUES (2, 1024, 64, 2, 8, 1, 'float32');
INSERT INTO plans VALUES (1, 1, 1, 'tiled', '{"rows_per_block": 64, "tile_size": 64}',
  'sha256:1111', 1, 0.8125, 0.003, 41.5, 1650.25, 0.000012, 0.75, 67108864, 2097152,
  'fa-4096x128', 17, '2026-11-30 12:00:00.000001');
INSERT INTO plans VALUES (2, 1, 1, 'scalar_online', '{"threads": 128}',
  'sha256:2222', 1, 3.5, 0.01, 9.6, 400.0, 0.00002, 3.1, 268435456, 2097152,
  'fa-4096x128', 3, '2026-11-30 12:01:00.000000');
INSERT INTO plans VALUES (3, 2, 2, 'tiled', '{"rows_per_block": 32, "tile_size": 32}',
  'sha256:1111', 0, 0.05, NULL, NULL, NULL, NULL, 0.05, 8388608, 524288,
  NULL, NULL, '2026-11-30 12:02:00.500000');
INSERT INTO best_plans VALUES (1, 1, 1);
INSERT INTO best_plans VALUES (2, 2, 3);
"""


def main() -> None:
    TARGET.unlink(missing_ok=True)
    engine = create_engine(f"sqlite:///{TARGET}")
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, "0001")
        for statement in ROWS.split(";"):
            if statement.strip():
                connection.execute(text(statement))
    with engine.connect() as connection:
        connection.exec_driver_sql("VACUUM")
    engine.dispose()
    print(f"wrote {TARGET} ({TARGET.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
