# The first release's dex_tasks/store/models.py (commit c28862d), kept unchanged below this line.
"""SQLModel tables: the store's schema.

Timestamps are stored as UTC epoch seconds (floats): they compare and index the same way on
SQLite and PostgreSQL, with no time-zone surprises. Views for users live in ``records.py``.
"""

from __future__ import annotations

from sqlalchemy import Column, Index, Text
from sqlmodel import Field, SQLModel


class ToolCallRow(SQLModel, table=True):
    """One tool call, keyed by its idempotency key, with the policy snapshot taken at request."""

    __tablename__ = "dex_tool_calls"
    __table_args__ = (
        # The lease reaper and the republisher look only at these, so both sweeps are
        # O(calls in that status), not O(all calls).
        Index("ix_dex_calls_status_lease", "status", "lease_expires_at"),
        Index("ix_dex_calls_status_published", "status", "published_at"),
    )

    key: str = Field(primary_key=True, max_length=512)
    session_id: str = Field(index=True, max_length=200)
    turn_id: str = Field(max_length=200)
    tool_call_id: str = Field(max_length=200)
    tool: str = Field(max_length=200)
    arguments: str = Field(sa_column=Column(Text, nullable=False))
    # Policy snapshot: later policy changes affect only later calls.
    effect: str = Field(max_length=32)
    requires_approval: bool
    max_attempts: int
    time_limit: float | None = None
    status: str = Field(index=True, max_length=32)
    prev_status: str | None = Field(default=None, max_length=32)
    result: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    attempts: int = 0
    interrupt_id: str | None = Field(default=None, max_length=64)
    worker: str | None = Field(default=None, max_length=255)
    lease_expires_at: float | None = None
    published_at: float | None = None
    # How often the stranded-call sweep republished it; each republish doubles the wait before
    # the next, so a long backlog (messages waiting, not lost) is not flooded with duplicates.
    republishes: int = 0
    expires_at: float | None = None
    created_at: float
    updated_at: float
    finished_at: float | None = None


class CallEventRow(SQLModel, table=True):
    """One transition of one call, written in the same transaction as the status change.

    ``id`` is the cursor of the session's event stream.
    """

    __tablename__ = "dex_call_events"
    __table_args__ = (Index("ix_dex_events_session_id", "session_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    session_id: str = Field(max_length=200)
    key: str = Field(index=True, max_length=512)
    event: str = Field(max_length=64)
    from_status: str | None = Field(default=None, max_length=32)
    to_status: str = Field(max_length=32)
    detail: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: float


class InterruptRow(SQLModel, table=True):
    """A pending (or decided) approval of one call."""

    __tablename__ = "dex_interrupts"
    __table_args__ = (
        # The deadline sweep reads only undecided interrupts whose deadline passed: O(overdue).
        Index("ix_dex_interrupts_open_deadline", "decision", "deadline_at"),
    )

    interrupt_id: str = Field(primary_key=True, max_length=64)
    key: str = Field(unique=True, max_length=512)
    session_id: str = Field(index=True, max_length=200)
    deadline_at: float | None = None
    created_at: float
    decision: str | None = Field(default=None, max_length=32)
    decided_by: str | None = Field(default=None, max_length=200)
    decided_at: float | None = None
    reason: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


class MessageRow(SQLModel, table=True):
    """A user message sent into a session; queued while a turn is open."""

    __tablename__ = "dex_messages"
    __table_args__ = (
        # Delivery looks only at queued messages (of one session, or all for the sweep).
        Index("ix_dex_messages_status_session", "status", "session_id"),
    )

    id: int | None = Field(default=None, primary_key=True)
    session_id: str = Field(index=True, max_length=200)
    text: str = Field(sa_column=Column(Text, nullable=False))
    status: str = Field(max_length=16)
    created_at: float
    delivered_at: float | None = None


class CatalogRow(SQLModel, table=True):
    """A tool published by a worker: its policy, MCP hints and argument schema."""

    __tablename__ = "dex_tool_catalog"

    name: str = Field(primary_key=True, max_length=200)
    policy: str = Field(sa_column=Column(Text, nullable=False))
    hints: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    arguments_schema: str = Field(sa_column=Column(Text, nullable=False))
    description: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    updated_at: float


class ReconciliationRow(SQLModel, table=True):
    """The report sent into a session about one ``outcome_unknown`` call: at most one per call.

    Inserted in the same transaction as the user message that carries the report, so when two
    reconcilers race, the second insert fails on the key and its message is rolled back.
    """

    __tablename__ = "dex_reconciliations"

    key: str = Field(primary_key=True, max_length=512)
    session_id: str = Field(index=True, max_length=200)
    message_id: int | None = None
    # Who answered: "check" (a function passed by the caller) or "reconciler:<tool>".
    checker: str = Field(max_length=255)
    report: str = Field(sa_column=Column(Text, nullable=False))
    reported_at: float
