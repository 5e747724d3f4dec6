"""SQLModel tables: the store's schema (what the migrations in ``migrations/`` build).

Changing a table here needs a migration: ``dex_tasks/store/migrations/versions`` (see
``schema.py``); a test compares the migrated schema with these models on both engines.

JSON columns (:class:`~dex_tasks.store.sqljson.JsonText`) are ``jsonb`` on PostgreSQL and
``TEXT`` on SQLite; the code sees JSON text on both. Event and message ids are 64-bit (``BIGINT`` on
PostgreSQL; SQLite's ``INTEGER PRIMARY KEY`` is 64-bit already).

Times are UTC epoch seconds in ``double precision`` columns, not ``timestamptz``, on purpose:

* index use is the same: a b-tree over floats serves ``lease_expires_at < :now`` or the prune's
  ``finished_at < :cutoff`` exactly as one over timestamps would;
* the sweeps compare and compute in seconds (a lease is ``now + lease_seconds``, an approved
  call's queue expiry moves by ``now - created_at``), which is plain arithmetic on floats on
  both engines; with ``timestamptz`` each would need interval arithmetic on PostgreSQL and
  another spelling on SQLite, which has no time type;
* the metrics' latency buckets are ``finished_at - created_at`` compared with seconds in one
  aggregate; with ``timestamptz`` that difference is an ``interval`` that needs
  ``extract(epoch from ...)`` on PostgreSQL only;
* psql users see numbers, the price: ``to_timestamp(created_at)`` shows a time
  (``select key, status, to_timestamp(finished_at) from dex_tool_calls``).

Views for users live in ``records.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from sqlalchemy import BigInteger, Column, Index, Integer, LargeBinary, Text, text
from sqlmodel import Field, SQLModel

from dex_tasks.limits import (
    APPROVER_MAX,
    INTERRUPT_ID_MAX,
    KEY_MAX,
    SESSION_ID_MAX,
    TOOL_CALL_ID_MAX,
    TOOL_NAME_MAX,
    TURN_ID_MAX,
)
from dex_tasks.store.sqljson import JsonText

# BIGINT on PostgreSQL; on SQLite only INTEGER PRIMARY KEY is the (64-bit) rowid that numbers
# itself, so the variant keeps it.
ID = BigInteger().with_variant(Integer(), "sqlite")


class ToolCallRow(SQLModel, table=True):
    """One tool call, keyed by its idempotency key, with the policy snapshot taken at request."""

    __tablename__ = "dex_tool_calls"
    __table_args__ = (
        # The lease reaper and the republisher look only at these, so both sweeps are
        # O(calls in that status), not O(all calls).
        # Partial (migration 0012): only a call holding a lease is in it, so a call's insert
        # and its end (which clears the lease) write no entry; the reaper's
        # ``lease_expires_at < ?`` implies the predicate, in generic plans too.
        Index("ix_dex_calls_status_lease", "status", "lease_expires_at",
              postgresql_where=text("lease_expires_at IS NOT NULL"),
              sqlite_where=text("lease_expires_at IS NOT NULL")),
        Index("ix_dex_calls_status_published", "status", "published_at"),
        # Prune reads terminal calls by finish time, and the reconcilers page through
        # outcome_unknown calls in finish order. (It replaces an index on status alone, which
        # these three made redundant.)
        # Partial (migration 0012): only ended calls, so the insert and the claim write no
        # entry; prune's ``finished_at < ?`` and the reconcilers' keyset (after their first
        # page, which reads the few outcome_unknown calls by status) imply the predicate.
        Index("ix_dex_calls_status_finished", "status", "finished_at",
              postgresql_where=text("finished_at IS NOT NULL"),
              sqlite_where=text("finished_at IS NOT NULL")),
        # /metrics counts the open calls by tool and effect class from this index alone, so a
        # scrape reads only the open calls' entries, never the ended ones (which grow for
        # ever). It also serves every lookup by status.
        Index("ix_dex_calls_status_tool_effect", "status", "tool", "effect"),
    )

    key: str = Field(primary_key=True, max_length=KEY_MAX)
    session_id: str = Field(index=True, max_length=SESSION_ID_MAX)
    turn_id: str = Field(max_length=TURN_ID_MAX)
    tool_call_id: str = Field(max_length=TOOL_CALL_ID_MAX)
    tool: str = Field(max_length=TOOL_NAME_MAX)
    arguments: str = Field(sa_column=Column(JsonText, nullable=False))
    # Policy snapshot: later policy changes affect only later calls.
    effect: str = Field(max_length=32)
    requires_approval: bool
    max_attempts: int
    time_limit: float | None = None
    status: str = Field(max_length=32)
    prev_status: str | None = Field(default=None, max_length=32)
    result: str | None = Field(default=None, sa_column=Column(JsonText, nullable=True))
    error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    attempts: int = 0
    interrupt_id: str | None = Field(default=None, max_length=INTERRUPT_ID_MAX)
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
    # Edit on approval: the arguments the model asked for, when a person approved other ones
    # (``arguments`` then holds those, which the tool runs with).
    original_arguments: str | None = Field(default=None,
                                           sa_column=Column(JsonText, nullable=True))
    # Policy snapshot of a rule on the arguments: the rule, its decision and why.
    approval_rule: str | None = Field(default=None, sa_column=Column(JsonText, nullable=True))
    # The W3C traceparent of the agent's span that requested it (OpenTelemetry, migration
    # 0011): the worker's and the approval's spans join that trace. None when not traced.
    trace_context: str | None = Field(default=None, max_length=64)


def stored_call(values: Mapping[str, Any]) -> ToolCallRow:
    """A :class:`ToolCallRow` from a whole row of ``dex_tool_calls`` as the store read it,
    without validating it again.

    SQLModel's validation of a table model sets each of its fields through SQLAlchemy's
    instrumentation: about 150 µs a row, more than reading it, on the path every call takes
    (a worker reads each call before its attempt; issue 29). The store's columns already hold
    the fields' types, but for SQLite's 0/1 booleans, made bools here. A row that lacks a
    column is validated, as are the sweeps' batches, which must skip a row they cannot read
    (``tables.valid_calls``). The copy shares the template's SQLAlchemy state, as every
    ``model_copy`` of a table model does: these rows are values, never added to an ORM
    session (the store writes with SQLAlchemy Core)."""
    update = dict(values)
    if not _CALL_FIELDS <= update.keys():
        return ToolCallRow.model_validate(update)
    update["requires_approval"] = bool(update["requires_approval"])
    return _call_template().model_copy(update=update)


_CALL_FIELDS = frozenset(ToolCallRow.model_fields)


@functools.cache
def _call_template() -> ToolCallRow:
    return ToolCallRow.model_validate({
        "key": "", "session_id": "", "turn_id": "", "tool_call_id": "", "tool": "",
        "arguments": "{}", "effect": "read", "requires_approval": False, "max_attempts": 1,
        "status": "queued", "created_at": 0.0, "updated_at": 0.0})


class CallEventRow(SQLModel, table=True):
    """One transition of one call, written in the same transaction as the status change.

    ``id`` is the cursor of the session's event stream.
    """

    __tablename__ = "dex_call_events"
    __table_args__ = (Index("ix_dex_events_session_id", "session_id", "id"),)

    id: int | None = Field(default=None, primary_key=True, sa_type=ID)
    session_id: str = Field(max_length=SESSION_ID_MAX)
    key: str = Field(index=True, max_length=KEY_MAX)
    event: str = Field(max_length=64)
    from_status: str | None = Field(default=None, max_length=32)
    to_status: str = Field(max_length=32)
    detail: str | None = Field(default=None, sa_column=Column(JsonText, nullable=True))
    created_at: float


class InterruptRow(SQLModel, table=True):
    """A pending (or decided) approval of one call."""

    __tablename__ = "dex_interrupts"
    __table_args__ = (
        # The deadline sweep reads only undecided interrupts whose deadline passed: O(overdue).
        Index("ix_dex_interrupts_open_deadline", "decision", "deadline_at"),
    )

    interrupt_id: str = Field(primary_key=True, max_length=INTERRUPT_ID_MAX)
    key: str = Field(unique=True, max_length=KEY_MAX)
    session_id: str = Field(index=True, max_length=SESSION_ID_MAX)
    deadline_at: float | None = None
    created_at: float
    decision: str | None = Field(default=None, max_length=32)
    decided_by: str | None = Field(default=None, max_length=APPROVER_MAX)
    decided_at: float | None = None
    reason: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # Several approvers (policy snapshot): how many distinct approvals decide, holding which
    # permission; how many were given so far (each one a row of dex_approvals).
    approvals_required: int = Field(default=1, sa_column_kwargs={"server_default": "1"})
    approvals_given: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    approver_permission: str | None = Field(default=None, max_length=64)
    # The tool's own webhook URLs (policy snapshot), besides DEX_WEBHOOK_URLS.
    webhook_urls: str | None = Field(default=None, sa_column=Column(JsonText, nullable=True))
    # When approval_deadline_near was announced (the warning sweep sets it once).
    deadline_warned_at: float | None = None
    # Who made the call (the MCP client's token identity, tokens.token_identity), and whether
    # the policy lets that identity decide it too (policy snapshot; None: it does not).
    requested_by: str | None = Field(default=None, max_length=APPROVER_MAX)
    self_approval: bool | None = None


class ApprovalVoteRow(SQLModel, table=True):
    """One approval of an interrupt that needs several, by one approver (at most one each)."""

    __tablename__ = "dex_approvals"

    interrupt_id: str = Field(primary_key=True, max_length=INTERRUPT_ID_MAX)
    approver: str = Field(primary_key=True, max_length=APPROVER_MAX)
    decided_at: float


class WebhookRow(SQLModel, table=True):
    """One delivery of one event to one URL: the outbox row, written in the transaction that
    made the event, and its delivery attempts (``dex-tasks webhooks``)."""

    __tablename__ = "dex_webhooks"
    __table_args__ = (
        # The republish sweep reads only pending deliveries, oldest publish first.
        Index("ix_dex_webhooks_status_published", "status", "published_at"),
    )

    delivery_id: str = Field(primary_key=True, max_length=64)
    event_id: str = Field(index=True, max_length=64)
    event: str = Field(max_length=64)
    session_id: str = Field(max_length=SESSION_ID_MAX)
    key: str = Field(index=True, max_length=KEY_MAX)  # prune deletes a call's deliveries
    url: str = Field(sa_column=Column(Text, nullable=False))
    payload: str = Field(sa_column=Column(JsonText, nullable=False))
    status: str = Field(max_length=16)
    attempts: int = 0
    last_status: int | None = None
    last_error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    created_at: float
    updated_at: float
    published_at: float | None = None
    delivered_at: float | None = None


class MessageRow(SQLModel, table=True):
    """One message of a session's transcript: a user's, the model's own text, or a tool result.

    ``role`` says which (``states.MessageRole``). User messages carry ``text`` and a delivery
    ``status`` (``queued`` while a turn of the session is open, then ``delivered``); assistant
    messages carry ``text`` and their ``turn_id``; tool messages are written by the transition
    that ends their call (``Store.transition``) and carry the call's ids, ``call_status``,
    ``tool_arguments`` and ``tool_output`` (the result's JSON text, or the error text), with
    ``text`` and ``status`` left NULL. One table, so the transcript is one ordered read.
    """

    __tablename__ = "dex_messages"
    __table_args__ = (
        # Delivery looks only at queued messages (of one session, or all for the sweep); only
        # user messages have a status, so tool and assistant messages are never in its range.
        # Partial (migration 0012): tool and assistant messages (status NULL, one per call)
        # write no entry; delivery's ``status = 'queued'`` implies the predicate.
        Index("ix_dex_messages_status_session", "status", "session_id",
              postgresql_where=text("status IS NOT NULL"),
              sqlite_where=text("status IS NOT NULL")),
        # One tool message per call, whatever code ended it: a backstop behind the guarded
        # transition (user and assistant messages have no key, and NULLs never collide).
        Index("ux_dex_messages_key", "key", unique=True),
        # One journaled model response per step of a turn (durable turns): two processes that
        # record the same step race on this index, and the loser reads the winner's.
        # Partial (migration 0012): rows without a step never collided (NULLs are distinct),
        # so only journaled steps need an entry; a call's tool message writes none.
        Index("ux_dex_messages_step", "session_id", "turn_id", "step", unique=True,
              postgresql_where=text("step IS NOT NULL"), sqlite_where=text("step IS NOT NULL")),
    )

    id: int | None = Field(default=None, primary_key=True, sa_type=ID)
    session_id: str = Field(index=True, max_length=SESSION_ID_MAX)
    # server_default: rows written before the transcript had roles were all user messages.
    role: str = Field(default="user", max_length=16,
                      sa_column_kwargs={"server_default": "user", "nullable": False})
    text: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    status: str | None = Field(default=None, max_length=16)
    created_at: float
    delivered_at: float | None = None
    turn_id: str | None = Field(default=None, max_length=TURN_ID_MAX)
    tool_call_id: str | None = Field(default=None, max_length=TOOL_CALL_ID_MAX)
    tool: str | None = Field(default=None, max_length=TOOL_NAME_MAX)
    key: str | None = Field(default=None, max_length=KEY_MAX)
    call_status: str | None = Field(default=None, max_length=32)
    tool_arguments: str | None = Field(default=None, sa_column=Column(JsonText, nullable=True))
    tool_output: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # Durable turns (``journal.py``): an assistant message that journals a model response has
    # its ``step`` (its position in the turn), the ``response`` as the adapter serialised it,
    # and the ``tool_calls`` it requested (``[{"tool_call_id", "tool", "arguments"}]``).
    step: int | None = None
    response: str | None = Field(default=None, sa_column=Column(JsonText, nullable=True))
    tool_calls: str | None = Field(default=None, sa_column=Column(JsonText, nullable=True))
    # A user message delivered after it waited (queued) sits right after message ``follows``,
    # the session's last message when its turn ended: the transcript's order, not the id's.
    follows: int | None = Field(default=None, sa_type=ID)


class TurnRow(SQLModel, table=True):
    """One turn of a session as a durable flow: begun by an input, ended by the model's answer.

    ``status`` is ``open`` until the model answers without requesting tools (``ended``). While
    a turn is open, user messages sent to its session wait (``queued``), and a restarted agent
    continues it from its journaled steps (assistant messages with a ``step``).
    """

    __tablename__ = "dex_turns"
    __table_args__ = (
        # The open turn of a session, and delivery's "is a turn open here?": one index range.
        Index("ix_dex_turns_status_session", "status", "session_id"),
        # Prune's ended turns, oldest first: a range of it, O(old turns) (migration 0009).
        Index("ix_dex_turns_status_ended", "status", "ended_at"),
    )

    session_id: str = Field(primary_key=True, max_length=SESSION_ID_MAX)
    turn_id: str = Field(primary_key=True, max_length=TURN_ID_MAX)
    input: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    status: str = Field(max_length=16)
    created_at: float
    ended_at: float | None = None


class CatalogRow(SQLModel, table=True):
    """A tool published by a worker: its policy, MCP hints and argument schema."""

    __tablename__ = "dex_tool_catalog"

    name: str = Field(primary_key=True, max_length=TOOL_NAME_MAX)
    policy: str = Field(sa_column=Column(JsonText, nullable=False))
    hints: str | None = Field(default=None, sa_column=Column(JsonText, nullable=True))
    arguments_schema: str = Field(sa_column=Column(JsonText, nullable=False))
    description: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    updated_at: float


class KeyRow(SQLModel, table=True):
    """A key the processes sharing this store sign with, made by the first one that needs it
    (``keys.Keys``): the ended records handed to waiters through Redis are signed with one,
    so only a process that can read the store can make a record its waiters believe."""

    __tablename__ = "dex_keys"

    name: str = Field(primary_key=True, max_length=64)
    value: str = Field(max_length=128)
    created_at: float


class CheckpointRow(SQLModel, table=True):
    """A LangGraph checkpoint (``DexCheckpointer``): the graph's state after one super-step,
    serialised by LangGraph's own serializer (``type`` names its format)."""

    __tablename__ = "dex_checkpoints"
    # Prune's old checkpoints, a page at a time in this order: a range of it, O(old
    # checkpoints) (migration 0009).
    __table_args__ = (Index("ix_dex_checkpoints_created", "created_at", "thread_id",
                            "checkpoint_ns", "checkpoint_id"),)

    thread_id: str = Field(sa_column=Column(Text, primary_key=True))
    checkpoint_ns: str = Field(sa_column=Column(Text, primary_key=True))
    checkpoint_id: str = Field(sa_column=Column(Text, primary_key=True))
    parent_checkpoint_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    type: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    checkpoint: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    # JSON text, not jsonb: metadata holds whatever a graph puts in its config, and a list's
    # filter compares it in Python the way LangGraph's in-memory saver does.
    checkpoint_metadata: str = Field(sa_column=Column("metadata", Text, nullable=False))
    created_at: float


class CheckpointWriteRow(SQLModel, table=True):
    """A pending write of a LangGraph task against a checkpoint (``put_writes``)."""

    __tablename__ = "dex_checkpoint_writes"

    thread_id: str = Field(sa_column=Column(Text, primary_key=True))
    checkpoint_ns: str = Field(sa_column=Column(Text, primary_key=True))
    checkpoint_id: str = Field(sa_column=Column(Text, primary_key=True))
    task_id: str = Field(sa_column=Column(Text, primary_key=True))
    idx: int = Field(sa_column=Column(Integer, primary_key=True, autoincrement=False))
    task_path: str = Field(sa_column=Column(Text, nullable=False))
    channel: str = Field(sa_column=Column(Text, nullable=False))
    type: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    value: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
