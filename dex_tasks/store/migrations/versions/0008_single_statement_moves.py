"""PostgreSQL: ``dex_call_ended_check``, what a terminal move's single statement calls.

A move that ends a call runs as one statement in autocommit (``store/transitions.py``). The
session's delivery lock is taken in that statement's RETURNING; a VOLATILE function reads at
a snapshot of its own taken after the lock, so it sees what the lock's previous holder
committed (a user message sent while the turn was open), which the statement's own snapshot,
taken before the lock, would not. It returns whether the session has user messages waiting.
SQLite keeps its transaction form and needs nothing.

Revision ID: 0008_single_statement_moves
Revises: 0007_checkpoints
"""

from __future__ import annotations

from alembic import op

revision = "0008_single_statement_moves"
down_revision = "0007_checkpoints"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("""
CREATE OR REPLACE FUNCTION dex_call_ended_check(lock_space integer, session text)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(lock_space, hashtext(session));
    RETURN EXISTS (SELECT 1 FROM dex_messages
                   WHERE dex_messages.status = 'queued' AND dex_messages.session_id = session);
END
$$
""")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS dex_call_ended_check(integer, text)")
