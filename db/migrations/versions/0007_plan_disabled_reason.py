"""Plans gain disabled_reason: ``python -m db verify`` marks a plan that fails parity or has
become slower than its stored time on this GPU, so that it is no longer served.

"" (the default, and every row from before) means served. A disabled plan stays
in the history with the reason; the best pointer of its problem x environment
moves to the next best plan that is not disabled (``db.writes.disable_plan``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(
            sa.Column("disabled_reason", sa.Text(), nullable=False, server_default="")
        )


def downgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("disabled_reason")
