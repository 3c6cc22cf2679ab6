"""Problems gain the attention variants, part of their identity: window, softcap, ALiBi, sinks.

A sliding window (``window_left``, ``window_right``: -1 for no bound on that side), a logit
softcap (0 for none), ALiBi and attention sinks (on or off) change what a kernel computes and
how fast, so they are columns of the problem's unique key: a windowed problem is never served
a dense plan, nor the other way round. Every row from before is plain attention: -1, -1, 0,
false, false (the server defaults), so old plans keep matching the same problems, whose
labels and study names are unchanged. The slope and sink values are run-time data, never
stored.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# The shape key as revision 0005 left it, and with the variants.
_SHAPE_BEFORE = [
    "head_dim", "dtype", "precision", "causal", "seq_len", "batch", "heads", "kv_heads", "kv_len"
]
_VARIANTS = ["window_left", "window_right", "softcap", "alibi", "sinks"]


def upgrade() -> None:
    # Changing a unique constraint recreates the table on SQLite (batch mode);
    # db.schema.upgrade turns foreign keys off for this, since plans refer to it.
    with op.batch_alter_table("problems") as batch:
        batch.add_column(
            sa.Column("window_left", sa.Integer(), nullable=False, server_default="-1")
        )
        batch.add_column(
            sa.Column("window_right", sa.Integer(), nullable=False, server_default="-1")
        )
        batch.add_column(sa.Column("softcap", sa.Double(), nullable=False, server_default="0"))
        batch.add_column(
            sa.Column("alibi", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(
            sa.Column("sinks", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", [*_SHAPE_BEFORE, *_VARIANTS])


def downgrade() -> None:
    # Refuses (unique violation) when a shape was tuned with and without a variant.
    with op.batch_alter_table("problems") as batch:
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", _SHAPE_BEFORE)
        for column in reversed(_VARIANTS):
            batch.drop_column(column)
