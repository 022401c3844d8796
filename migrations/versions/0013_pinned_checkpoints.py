"""`checkpoints.pinned`: a version the weight server's retention keeps, with what it is built on, whatever its age.
A Tinker `save_weights_for_sampler(name)` checkpoint is a version of its model's run and lives until its record
is deleted or expires; retention kept only the newest KEEP_LAST versions, so an older named checkpoint lost its
weights while still recorded. The trainer pins such a version as it publishes it and unpins it when the last
record naming it goes. Rows already there are unpinned.

Revision ID: 0013_pinned_checkpoints
Revises: 0012_linear_step_storage
"""

import sqlalchemy as sa
from alembic import op

revision = "0013_pinned_checkpoints"
down_revision = "0012_linear_step_storage"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.text("false")))


def downgrade() -> None:
    op.drop_column("checkpoints", "pinned")
