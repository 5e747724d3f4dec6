"""Partial indexes where a call's hot path wrote entries no read uses (issue 29).

Measured with ``python -m bench pgindex`` (pg_stat_statements and the WAL of the path: a call's
insert, claim, end and read): every secondary index on a table the path writes costs an entry
per row version, and on ``dex_tool_calls`` each status move writes a new version into every
index (``status`` is in four of them, so no update is HOT). Four indexes only ever serve reads
whose conditions name a column that is NULL for most of those versions, so they become partial
on it and the path skips them:

- ``ix_dex_calls_status_lease`` WHERE ``lease_expires_at IS NOT NULL``: the reaper reads
  ``status = 'running' AND lease_expires_at < ?``; the insert and the end hold no lease;
- ``ix_dex_calls_status_finished`` WHERE ``finished_at IS NOT NULL``: prune and the
  reconcilers read ended calls by finish time (their first page reads the few outcome_unknown
  calls by status); the insert and the claim are not ended;
- ``ix_dex_messages_status_session`` WHERE ``status IS NOT NULL``: delivery reads queued user
  messages; a call's tool message has no status;
- ``ux_dex_messages_step`` WHERE ``step IS NOT NULL``: one journaled response per step; rows
  without a step never collided on it (NULLs are distinct), and a tool message has none.

Each read's condition implies its index's predicate (a strict comparison on the column), so
the planners of both engines still use the index, in PostgreSQL's generic plans too.

Revision ID: 0012_partial_indexes
Revises: 0011_trace_context
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_partial_indexes"
down_revision = "0011_trace_context"
branch_labels = None
depends_on = None

# (index, table, columns, unique, predicate)
PARTIAL = (
    ("ix_dex_calls_status_lease", "dex_tool_calls", ["status", "lease_expires_at"], False,
     "lease_expires_at IS NOT NULL"),
    ("ix_dex_calls_status_finished", "dex_tool_calls", ["status", "finished_at"], False,
     "finished_at IS NOT NULL"),
    ("ix_dex_messages_status_session", "dex_messages", ["status", "session_id"], False,
     "status IS NOT NULL"),
    ("ux_dex_messages_step", "dex_messages", ["session_id", "turn_id", "step"], True,
     "step IS NOT NULL"),
)


def upgrade() -> None:
    for name, table, columns, unique, predicate in PARTIAL:
        op.drop_index(name, table_name=table)
        op.create_index(name, table, columns, unique=unique,
                        postgresql_where=sa.text(predicate), sqlite_where=sa.text(predicate))


def downgrade() -> None:
    for name, table, columns, unique, _predicate in PARTIAL:
        op.drop_index(name, table_name=table)
        op.create_index(name, table, columns, unique=unique)
