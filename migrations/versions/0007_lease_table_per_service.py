"""One lease table per service that leases runs, each written only by its service: `run_leases` (rows per
(run, role)) becomes `controller_leases` (its controller rows) and `trainer_leases` (the trainer's). The rows
are leases of at most a minute, so the trainer's are not carried over: a running trainer takes its runs again
at its next renewal.

Revision ID: 0007_leases
Revises: 0006_outcomes
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_leases"
down_revision = "0006_outcomes"
branch_labels = None
depends_on = None


def _lease_table(name: str) -> None:
    op.create_table(
        name,
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id"),
    )


def upgrade() -> None:
    _lease_table("controller_leases")
    _lease_table("trainer_leases")
    op.execute("INSERT INTO controller_leases (run_id, owner, expires_at) "
               "SELECT run_id, owner, expires_at FROM run_leases WHERE role = 'controller'")
    op.drop_table("run_leases")


def downgrade() -> None:
    op.create_table(
        "run_leases",
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("role", sa.String(length=32), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "role"),
    )
    op.execute("INSERT INTO run_leases (run_id, role, owner, expires_at) "
               "SELECT run_id, 'controller', owner, expires_at FROM controller_leases UNION ALL "
               "SELECT run_id, 'trainer', owner, expires_at FROM trainer_leases")
    op.drop_table("trainer_leases")
    op.drop_table("controller_leases")
