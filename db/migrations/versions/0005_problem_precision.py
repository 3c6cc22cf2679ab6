"""Problems gain precision, part of their identity: float32 plans of one TF32 pass are kept apart.

A float32 problem asks for ``tf32x3`` (float32-class error, the default) or
``tf32`` (one-pass TF32 tensor-core plans allowed); a plan stored for ``tf32``
must never be served to a caller who asked for ``tf32x3``, so the precision is
a column of the problem's unique key. Every float32 row from before was tuned
with float32-class kernels only: it reads as ``tf32x3``. Half-precision rows
get "" (the field does not apply to them).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The shape key as revision 0004 left it (kv_heads, kv_len added) and with precision.
_SHAPE_BEFORE = ["head_dim", "dtype", "causal", "seq_len", "batch", "heads", "kv_heads", "kv_len"]
_SHAPE_AFTER = [
    "head_dim", "dtype", "precision", "causal", "seq_len", "batch", "heads", "kv_heads", "kv_len"
]


def upgrade() -> None:
    # Changing a unique constraint recreates the table on SQLite (batch mode);
    # db.schema.upgrade turns foreign keys off for this, since plans refer to it.
    with op.batch_alter_table("problems") as batch:
        batch.add_column(sa.Column("precision", sa.String(16), nullable=False, server_default=""))
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", _SHAPE_AFTER)
    op.execute("UPDATE problems SET precision = 'tf32x3' WHERE dtype = 'float32'")


def downgrade() -> None:
    # Refuses (unique violation) when a shape was tuned under both precisions.
    with op.batch_alter_table("problems") as batch:
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", _SHAPE_BEFORE)
        batch.drop_column("precision")
