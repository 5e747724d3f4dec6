"""Indexes for ``dex-tasks prune``: ended turns and old LangGraph checkpoints.

Prune deletes the turns that ended before its cutoff and the checkpoints of threads with
nothing open; these indexes let it find them by a range scan, so its cost follows what it
deletes, not the tables' size: ``dex_turns (status, ended_at)`` and ``dex_checkpoints
(created_at, thread_id, checkpoint_ns, checkpoint_id)``, the order prune pages them in.

Revision ID: 0009_prune_indexes
Revises: 0008_single_statement_moves
"""

from __future__ import annotations

from alembic import op

revision = "0009_prune_indexes"
down_revision = "0008_single_statement_moves"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_dex_turns_status_ended", "dex_turns", ["status", "ended_at"])
    op.create_index("ix_dex_checkpoints_created", "dex_checkpoints",
                    ["created_at", "thread_id", "checkpoint_ns", "checkpoint_id"])


def downgrade() -> None:
    op.drop_index("ix_dex_checkpoints_created", table_name="dex_checkpoints")
    op.drop_index("ix_dex_turns_status_ended", table_name="dex_turns")
