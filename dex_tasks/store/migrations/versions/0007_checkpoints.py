"""LangGraph checkpoints in the store (``DexCheckpointer``): ``dex_checkpoints`` and
``dex_checkpoint_writes``, so a LangGraph agent needs no second database.

Their shape is LangGraph's own SQLite saver's (a checkpoint per thread, namespace and id with
its parent; a task's pending writes by index), the blobs in LangGraph's serializer's format.

Revision ID: 0007_checkpoints
Revises: 0006_approvals_webhooks
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_checkpoints"
down_revision = "0006_approvals_webhooks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dex_checkpoints",
        sa.Column("thread_id", sa.Text(), nullable=False),
        sa.Column("checkpoint_ns", sa.Text(), nullable=False),
        sa.Column("checkpoint_id", sa.Text(), nullable=False),
        sa.Column("parent_checkpoint_id", sa.Text(), nullable=True),
        sa.Column("type", sa.Text(), nullable=True),
        sa.Column("checkpoint", sa.LargeBinary(), nullable=False),
        sa.Column("metadata", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("thread_id", "checkpoint_ns", "checkpoint_id"),
    )
    op.create_table(
        "dex_checkpoint_writes",
        sa.Column("thread_id", sa.Text(), nullable=False),
        sa.Column("checkpoint_ns", sa.Text(), nullable=False),
        sa.Column("checkpoint_id", sa.Text(), nullable=False),
        sa.Column("task_id", sa.Text(), nullable=False),
        sa.Column("idx", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("task_path", sa.Text(), nullable=False),
        sa.Column("channel", sa.Text(), nullable=False),
        sa.Column("type", sa.Text(), nullable=True),
        sa.Column("value", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx"),
    )


def downgrade() -> None:
    op.drop_table("dex_checkpoint_writes")
    op.drop_table("dex_checkpoints")
