"""The session transcript: tool and assistant messages in ``dex_messages``; no
``dex_reconciliations``.

``dex_messages`` gets a ``role`` (the rows already there were all user messages, hence the
server default), the tool-message columns, nullable ``text`` and ``status`` (tool messages have
neither), and a unique index on ``key`` (one tool message per call). Calls that ended before
the upgrade get their tool message here, as if the transition that ended them had written it.
Their ids come after the messages already stored (ids are public and keep their order), so a
session from before the upgrade lists its calls' tool messages after its user messages; each
one's ``created_at`` is when its call ended.

``dex_reconciliations`` goes: a report is a user message naming the call's key (which the first
release wrote too, in the same transaction as its reconciliation row), and that one rule now
decides whether a call was reported.

Revision ID: 0002_transcript
Revises: 0001_first_release
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_transcript"
down_revision = "0001_first_release"
branch_labels = None
depends_on = None

TERMINAL = ("succeeded", "failed", "rejected", "outcome_unknown")


def upgrade() -> None:
    # Batch mode: SQLite cannot change a column's nullability in place, so the table is
    # copied (inside this transaction); PostgreSQL gets plain ALTERs.
    with op.batch_alter_table("dex_messages") as batch:
        batch.add_column(sa.Column("role", sa.String(length=16), server_default="user",
                                   nullable=False))
        batch.alter_column("text", existing_type=sa.Text(), nullable=True)
        batch.alter_column("status", existing_type=sa.String(length=16), nullable=True)
        batch.add_column(sa.Column("turn_id", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("tool_call_id", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("tool", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("key", sa.String(length=512), nullable=True))
        batch.add_column(sa.Column("call_status", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("tool_arguments", sa.Text(), nullable=True))
        batch.add_column(sa.Column("tool_output", sa.Text(), nullable=True))
        batch.create_index("ux_dex_messages_key", ["key"], unique=True)

    statuses = ", ".join(f"'{s}'" for s in TERMINAL)
    op.execute(
        "INSERT INTO dex_messages (session_id, role, created_at, turn_id, tool_call_id, tool, "
        "key, call_status, tool_arguments, tool_output) "
        "SELECT session_id, 'tool', COALESCE(finished_at, updated_at), turn_id, tool_call_id, "
        "tool, key, status, arguments, "
        "CASE WHEN status = 'succeeded' THEN result ELSE error END "
        f"FROM dex_tool_calls WHERE status IN ({statuses}) "
        "ORDER BY COALESCE(finished_at, updated_at), key"
    )

    op.drop_index("ix_dex_reconciliations_session_id", table_name="dex_reconciliations")
    op.drop_table("dex_reconciliations")


def downgrade() -> None:
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
    # The first release's transcript held user messages only.
    op.execute("DELETE FROM dex_messages WHERE role <> 'user'")
    with op.batch_alter_table("dex_messages") as batch:
        batch.drop_index("ux_dex_messages_key")
        for column in ("tool_output", "tool_arguments", "call_status", "key", "tool",
                       "tool_call_id", "turn_id", "role"):
            batch.drop_column(column)
        batch.alter_column("text", existing_type=sa.Text(), nullable=False)
        batch.alter_column("status", existing_type=sa.String(length=16), nullable=False)
