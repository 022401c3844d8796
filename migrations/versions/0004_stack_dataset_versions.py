"""Dataset versions: a (name, split) holds immutable versions 1, 2, ...; re-import adds one. Existing datasets
become version 1, and every existing run pins version 1 of its dataset (what it has been reading).

Revision ID: 0003_stack
Revises: 0003_linear
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_stack"
down_revision = "0003_linear"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("datasets", sa.Column("version", sa.Integer(), server_default="1", nullable=False))
    op.drop_constraint("uq_datasets_name_split", "datasets", type_="unique")
    op.create_unique_constraint("uq_datasets_name_split_version", "datasets", ["name", "split", "version"])
    op.execute("UPDATE runs SET config = config || '{\"dataset_version\": 1}'::jsonb "
               "WHERE NOT config ? 'dataset_version' OR config->'dataset_version' = 'null'::jsonb")


def downgrade() -> None:
    # Only the latest version of each (name, split) survives: the old schema holds one per name and split.
    op.execute("DELETE FROM datasets d USING datasets newer WHERE newer.name = d.name AND newer.split = d.split "
               "AND newer.version > d.version")
    op.execute("UPDATE runs SET config = config - 'dataset_version'")
    op.drop_constraint("uq_datasets_name_split_version", "datasets", type_="unique")
    op.create_unique_constraint("uq_datasets_name_split", "datasets", ["name", "split"])
    op.drop_column("datasets", "version")
