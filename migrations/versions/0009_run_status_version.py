"""`runs.status_version`: a sequence number bumped by every status change, in the change's transaction. Run
control messages carry it, so a controller orders a pause or stop against its own read of the runs table by
this number, never by two hosts' clocks.

Revision ID: 0009_status_version
Revises: 0008_requeued
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_status_version"
down_revision = "0008_requeued"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("status_version", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("runs", "status_version")
