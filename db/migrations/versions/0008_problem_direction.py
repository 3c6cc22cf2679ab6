"""Problems gain a direction, part of their identity: backward (gradient) plans are kept apart.

A backward problem (dQ, dK, dV of a forward of the same shape) is tuned and served apart
from its forward: the direction is a column of the problem's unique key. Every row from
before was a forward problem: it reads as "forward".

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The shape key as revision 0006 left it (the variants added; 0007 changed plans only) and
# with the direction.
_SHAPE_BEFORE = [
    "head_dim", "dtype", "precision", "causal", "seq_len", "batch", "heads", "kv_heads", "kv_len",
    "window_left", "window_right", "softcap", "alibi", "sinks",
]  # fmt: skip
# The direction right after the precision: the index prefix the nearest-shape lookup filters on.
_SHAPE_AFTER = [*_SHAPE_BEFORE[:3], "direction", *_SHAPE_BEFORE[3:]]


def upgrade() -> None:
    # Changing a unique constraint recreates the table on SQLite (batch mode);
    # db.schema.upgrade turns foreign keys off for this, since plans refer to it.
    with op.batch_alter_table("problems") as batch:
        batch.add_column(
            sa.Column("direction", sa.String(16), nullable=False, server_default="forward")
        )
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", _SHAPE_AFTER)


def downgrade() -> None:
    # Refuses (unique violation) when a shape was tuned in both directions.
    with op.batch_alter_table("problems") as batch:
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", _SHAPE_BEFORE)
        batch.drop_column("direction")
