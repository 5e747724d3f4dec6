"""Durable turns: ``dex_turns``, and the journal's columns on ``dex_messages``.

``dex_turns`` holds each turn begun with ``DexClient.begin_turn`` (its input, ``open`` until the
model answers without tools). ``dex_messages`` gets ``step``, ``response`` and ``tool_calls``
(an assistant message that journals one model response of a turn, unique per session, turn and
step) and ``follows`` (where a user message that waited for its turn sits in the transcript).
Every new column is nullable: the rows already stored are messages of no journaled turn.

Revision ID: 0005_durable_turns
Revises: 0004_open_calls_index
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from dex_tasks.store.sqljson import JsonText

revision = "0005_durable_turns"
down_revision = "0004_open_calls_index"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "dex_turns",
        sa.Column("session_id", sa.String(length=200), nullable=False),
        sa.Column("turn_id", sa.String(length=200), nullable=False),
        sa.Column("input", sa.Text(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("session_id", "turn_id"),
    )
    op.create_index("ix_dex_turns_status_session", "dex_turns", ["status", "session_id"])
    # Nullable columns only: SQLite adds them in place, no table copy.
    with op.batch_alter_table("dex_messages") as batch:
        batch.add_column(sa.Column("step", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("response", JsonText(), nullable=True))
        batch.add_column(sa.Column("tool_calls", JsonText(), nullable=True))
        batch.add_column(sa.Column("follows", _ID, nullable=True))
        batch.create_index("ux_dex_messages_step", ["session_id", "turn_id", "step"],
                           unique=True)


def downgrade() -> None:
    with op.batch_alter_table("dex_messages") as batch:
        batch.drop_index("ux_dex_messages_step")
        for column in ("follows", "tool_calls", "response", "step"):
            batch.drop_column(column)
    op.drop_index("ix_dex_turns_status_session", table_name="dex_turns")
    op.drop_table("dex_turns")
