"""Problems gain page_size and lengths: serving buckets are tuned and served apart.

A serving problem (``kernels.serving``) is a batch of requests against a paged KV cache of
``page_size`` tokens a page (0: contiguous) whose lengths follow a distribution (``lengths``:
``equal``, ``uniform``, ``skewed`` or ``values:...``, ``tuner.lengths``). Both are part of
the problem's unique key, so a decode bucket with a paged cache and skewed lengths keeps a
plan of its own. Every row from before is a dense problem: page_size 0 and lengths
``equal``, which is what those problems mean today (their labels and study names are
unchanged).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# The shape key as revision 0008 left it (variants, direction), and with the serving fields.
_SHAPE_BEFORE = [
    "head_dim", "dtype", "precision", "direction", "causal", "seq_len", "batch", "heads",
    "kv_heads", "kv_len", "window_left", "window_right", "softcap", "alibi", "sinks",
]  # fmt: skip
_SHAPE_AFTER = [*_SHAPE_BEFORE, "page_size", "lengths"]


def upgrade() -> None:
    # Server defaults fill the old rows; changing the unique constraint recreates the table on
    # SQLite (batch mode; db.schema.upgrade turns foreign keys off for it).
    with op.batch_alter_table("problems") as batch:
        batch.add_column(sa.Column("page_size", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(
            sa.Column("lengths", sa.String(1024), nullable=False, server_default="equal")
        )
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", _SHAPE_AFTER)


def downgrade() -> None:
    # Refuses (unique violation) when two problems differ only by page size or lengths.
    with op.batch_alter_table("problems") as batch:
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", _SHAPE_BEFORE)
        batch.drop_column("lengths")
        batch.drop_column("page_size")
