"""Problems gain kv_heads and kv_len: grouped-query attention and decode against a KV cache.

k and v may have fewer heads than q (``kv_heads`` divides ``heads``) and
another length (``kv_len``; ``seq_len`` is the query length). Both are part of
the problem's unique key. Every row from before is self-attention, so it gets
``kv_heads = heads`` and ``kv_len = seq_len``: old plans keep matching the same
problems, whose labels and study names are unchanged.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_SHAPE_0003 = ["head_dim", "dtype", "causal", "seq_len", "batch", "heads"]


def upgrade() -> None:
    # Nullable first, filled from the row's own heads and seq_len, then required;
    # changing the unique constraint recreates the table on SQLite (batch mode).
    with op.batch_alter_table("problems") as batch:
        batch.add_column(sa.Column("kv_heads", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("kv_len", sa.Integer(), nullable=True))
    op.execute("UPDATE problems SET kv_heads = heads WHERE kv_heads IS NULL")
    op.execute("UPDATE problems SET kv_len = seq_len WHERE kv_len IS NULL")
    with op.batch_alter_table("problems") as batch:
        batch.alter_column("kv_heads", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("kv_len", existing_type=sa.Integer(), nullable=False)
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", [*_SHAPE_0003, "kv_heads", "kv_len"])


def downgrade() -> None:
    # Refuses (unique violation) when two problems differ only by kv_heads or kv_len.
    with op.batch_alter_table("problems") as batch:
        batch.drop_constraint("uq_problems_shape", type_="unique")
        batch.create_unique_constraint("uq_problems_shape", _SHAPE_0003)
        batch.drop_column("kv_len")
        batch.drop_column("kv_heads")
