"""Initial schema: environments, problems, plans (history) and best-plan pointers.

Revision ID: 0001
Revises:
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "environments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("gpu_name", sa.String(128), nullable=False),
        sa.Column("compute_capability", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("driver_version", sa.String(64), nullable=False),
        sa.Column("cuda_version", sa.String(64), nullable=False),
        sa.Column("nvcc_version", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_environments"),
        sa.UniqueConstraint(
            "gpu_name",
            "compute_capability",
            "sm_count",
            "driver_version",
            "cuda_version",
            "nvcc_version",
            name="uq_environments_identity",
        ),
    )
    op.create_table(
        "problems",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("seq_len", sa.Integer(), nullable=False),
        sa.Column("head_dim", sa.Integer(), nullable=False),
        sa.Column("batch", sa.Integer(), nullable=False),
        sa.Column("heads", sa.Integer(), nullable=False),
        sa.Column("causal", sa.Boolean(), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_problems"),
        sa.UniqueConstraint(
            "head_dim", "dtype", "causal", "seq_len", "batch", "heads", name="uq_problems_shape"
        ),
    )
    op.create_table(
        "plans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=False),
        sa.Column("family", sa.String(64), nullable=False),
        sa.Column("params", sa.Text(), nullable=False),
        sa.Column("source_hash", sa.String(128), nullable=False),
        sa.Column("measured", sa.Boolean(), nullable=False),
        sa.Column("median_ms", sa.Double(), nullable=True),
        sa.Column("spread_ms", sa.Double(), nullable=True),
        sa.Column("tflops", sa.Double(), nullable=True),
        sa.Column("gbps", sa.Double(), nullable=True),
        sa.Column("max_abs_error", sa.Double(), nullable=True),
        sa.Column("predicted_ms", sa.Double(), nullable=True),
        sa.Column("predicted_read_bytes", sa.BigInteger(), nullable=True),
        sa.Column("predicted_write_bytes", sa.BigInteger(), nullable=True),
        sa.Column("study_name", sa.String(256), nullable=True),
        sa.Column("trial_number", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["problem_id"], ["problems.id"], name="fk_plans_problem_id_problems"
        ),
        sa.ForeignKeyConstraint(
            ["environment_id"], ["environments.id"], name="fk_plans_environment_id_environments"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_plans"),
    )
    op.create_index(
        "ix_plans_lookup", "plans", ["problem_id", "environment_id", "measured", "median_ms"]
    )
    op.create_table(
        "best_plans",
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["problem_id"], ["problems.id"], name="fk_best_plans_problem_id_problems"
        ),
        sa.ForeignKeyConstraint(
            ["environment_id"],
            ["environments.id"],
            name="fk_best_plans_environment_id_environments",
        ),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"], name="fk_best_plans_plan_id_plans"),
        sa.PrimaryKeyConstraint("problem_id", "environment_id", name="pk_best_plans"),
    )


def downgrade() -> None:
    op.drop_table("best_plans")
    op.drop_index("ix_plans_lookup", table_name="plans")
    op.drop_table("plans")
    op.drop_table("problems")
    op.drop_table("environments")
