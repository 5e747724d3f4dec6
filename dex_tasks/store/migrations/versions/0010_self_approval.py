"""Who made a call that waits for approval, so that identity cannot decide it.

``dex_interrupts`` gets ``requested_by`` (the identity of the token that made the call through
the MCP server: its name, or a digest standing for an unnamed token) and ``self_approval`` (the
policy's ``allow_self_approval``, snapshotted with the call). Both are nullable: interrupts
stored before read as calls of nobody in particular, decided as before.

Revision ID: 0010_self_approval
Revises: 0009_prune_indexes
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_self_approval"
down_revision = "0009_prune_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dex_interrupts") as batch:
        batch.add_column(sa.Column("requested_by", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("self_approval", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dex_interrupts") as batch:
        batch.drop_column("self_approval")
        batch.drop_column("requested_by")
