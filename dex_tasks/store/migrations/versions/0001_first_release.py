"""The schema of the first release (commit c28862d), which built its tables with create_all.

A database that release created has no version table: ``dex-tasks db upgrade`` stamps it with
this revision and goes on from here. A test builds this revision and that release's
``create_all`` side by side and compares what the two databases hold, on both engines.

Revision ID: 0001_first_release
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_first_release"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dex_call_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("event", sa.String(length=64), nullable=False),
        sa.Column("from_status", sa.String(length=32), nullable=True),
        sa.Column("to_status", sa.String(length=32), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_dex_call_events_key", "dex_call_events", ["key"])
    op.create_index("ix_dex_events_session_id", "dex_call_events", ["session_id", "id"])

    op.create_table(
        "dex_interrupts",
        sa.Column("interrupt_id", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("session_id", sa.String(length=200), nullable=False),
        sa.Column("deadline_at", sa.Float(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("decision", sa.String(length=32), nullable=True),
        sa.Column("decided_by", sa.String(length=200), nullable=True),
        sa.Column("decided_at", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("interrupt_id"),
        sa.UniqueConstraint("key"),
    )
    op.create_index("ix_dex_interrupts_open_deadline", "dex_interrupts",
                    ["decision", "deadline_at"])
    op.create_index("ix_dex_interrupts_session_id", "dex_interrupts", ["session_id"])

    op.create_table(
        "dex_messages",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.String(length=200), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_dex_messages_session_id", "dex_messages", ["session_id"])
    op.create_index("ix_dex_messages_status_session", "dex_messages", ["status", "session_id"])

    op.create_table(
        "dex_reconciliations",
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("session_id", sa.String(length=200), nullable=False),
        sa.Column("message_id", sa.Integer(), nullable=True),
        sa.Column("checker", sa.String(length=255), nullable=False),
        sa.Column("report", sa.Text(), nullable=False),
        sa.Column("reported_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_index("ix_dex_reconciliations_session_id", "dex_reconciliations", ["session_id"])

    op.create_table(
        "dex_tool_calls",
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("session_id", sa.String(length=200), nullable=False),
        sa.Column("turn_id", sa.String(length=200), nullable=False),
        sa.Column("tool_call_id", sa.String(length=200), nullable=False),
        sa.Column("tool", sa.String(length=200), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("effect", sa.String(length=32), nullable=False),
        sa.Column("requires_approval", sa.Boolean(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("time_limit", sa.Float(), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("prev_status", sa.String(length=32), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("interrupt_id", sa.String(length=64), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("published_at", sa.Float(), nullable=True),
        sa.Column("republishes", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_index("ix_dex_calls_status_published", "dex_tool_calls", ["status", "published_at"])
    op.create_index("ix_dex_calls_status_lease", "dex_tool_calls", ["status", "lease_expires_at"])
    op.create_index("ix_dex_tool_calls_session_id", "dex_tool_calls", ["session_id"])
    op.create_index("ix_dex_tool_calls_status", "dex_tool_calls", ["status"])

    op.create_table(
        "dex_tool_catalog",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("policy", sa.Text(), nullable=False),
        sa.Column("hints", sa.Text(), nullable=True),
        sa.Column("arguments_schema", sa.Text(), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    for table in ("dex_tool_catalog", "dex_tool_calls", "dex_reconciliations", "dex_messages",
                  "dex_interrupts", "dex_call_events"):
        op.drop_table(table)
