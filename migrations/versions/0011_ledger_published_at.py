"""`rollout_tasks.published_at`: when a dispatched task was known to be on `rollout.tasks` (NULL until then). The
controller commits a ledger row before it publishes the task; one that dies in between left the row dispatched
and the task nowhere until its lease (the run's trajectory timeout) expired. Rows already there are taken as
published (only dispatched rows matter: an ended row is never published again).

Revision ID: 0011_ledger_published_at
Revises: 0010_tracker_progress
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_ledger_published_at"
down_revision = "0010_tracker_progress"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("rollout_tasks", sa.Column("published_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE rollout_tasks SET published_at = dispatched_at WHERE status = 'dispatched'")


def downgrade() -> None:
    op.drop_column("rollout_tasks", "published_at")
