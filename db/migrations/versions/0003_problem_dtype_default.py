"""Problems: dtype is part of every lookup; rows from before it mattered read as float32.

0001 already made ``dtype`` a column of the problem's unique key, and every
row written since holds the dtype of its Problem, which was always float32.
Now that bfloat16 and float16 problems are tuned too, a row without a dtype
(NULL or "", from a hand-written or foreign writer) must not match them: it
is set to float32, and the column gets a server default of float32 so such
writers keep meaning what they meant.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE problems SET dtype = 'float32' WHERE dtype IS NULL OR dtype = ''")
    with op.batch_alter_table("problems") as batch:
        batch.alter_column(
            "dtype",
            existing_type=sa.String(16),
            existing_nullable=False,
            server_default="float32",
        )


def downgrade() -> None:
    with op.batch_alter_table("problems") as batch:
        batch.alter_column(
            "dtype", existing_type=sa.String(16), existing_nullable=False, server_default=None
        )
