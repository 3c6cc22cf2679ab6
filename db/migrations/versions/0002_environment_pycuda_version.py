"""Environments gain pycuda_version, part of their identity.

PyCUDA's version changes how kernels are launched, so timings under different
versions are kept apart. Rows from 0001 get "" (unknown), as the Environment
type does for an unknown field.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_IDENTITY_0001 = [
    "gpu_name",
    "compute_capability",
    "sm_count",
    "driver_version",
    "cuda_version",
    "nvcc_version",
]


def upgrade() -> None:
    # Changing a unique constraint recreates the table on SQLite (batch mode);
    # db.schema.upgrade turns foreign keys off for this, since plans refer to it.
    with op.batch_alter_table("environments") as batch:
        batch.add_column(
            sa.Column("pycuda_version", sa.String(64), nullable=False, server_default="")
        )
        batch.drop_constraint("uq_environments_identity", type_="unique")
        batch.create_unique_constraint(
            "uq_environments_identity", [*_IDENTITY_0001, "pycuda_version"]
        )


def downgrade() -> None:
    # Refuses (unique violation) when two environments differ only by pycuda_version.
    with op.batch_alter_table("environments") as batch:
        batch.drop_constraint("uq_environments_identity", type_="unique")
        batch.create_unique_constraint("uq_environments_identity", _IDENTITY_0001)
        batch.drop_column("pycuda_version")
