"""one lease table for every service (`run_leases`), the controller's record of what the trainer consumed
(`consumed_groups`, fed by `trainer.progress`), and each trainer sample's batch (its group).

Revision ID: 0003_linear
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_linear"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_leases",
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("role", sa.String(length=32), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "role"),
    )
    op.create_table(
        "consumed_groups",
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("task_id", sa.String(length=200), nullable=False),
        sa.Column("batch_idx", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "task_id", "batch_idx"),
    )
    op.add_column("train_samples", sa.Column("batch_idx", sa.Integer(), nullable=True))
    op.drop_column("runs", "lease_owner")
    op.drop_column("runs", "lease_expires_at")


def downgrade() -> None:
    op.add_column("runs", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("runs", sa.Column("lease_owner", sa.String(length=200), nullable=True))
    op.drop_column("train_samples", "batch_idx")
    op.drop_table("consumed_groups")
    op.drop_table("run_leases")
