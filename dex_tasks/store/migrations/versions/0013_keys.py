"""Keys shared by the processes of one store: ``dex_keys``.

An ended call's record travels to its waiters with the Redis notification that wakes them
(DESIGN version 4), signed so that a message anyone with Redis access could publish is not
believed. The key it is signed with was ``DEX_SECRET_KEY``, which only the API needs, so a
deployment without one had every waiter read the store again. The key now lives in the store,
made at random by the first process that needs it: every process of a deployment shares it
without configuration, and only one that can read the store can sign a record.

Revision ID: 0013_keys
Revises: 0012_partial_indexes
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_keys"
down_revision = "0012_partial_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dex_keys",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("dex_keys")
