"""`tracker_progress`: the newest policy version each experiment tracker of a run holds. A trainer that opens a
run again (restart, crash, another trainer) re-sends each tracker the versions committed after that one, from
the `metrics` table, so a crash between a step's commit and its tracker call loses no version.

Revision ID: 0010_tracker_progress
Revises: 0009_status_version
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_tracker_progress"
down_revision = "0009_status_version"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tracker_progress",
        sa.Column("run_id", sa.UUID(), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("tracker", sa.String(32), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tracker_progress")
