"""Pruning: deleting finished calls and old transcript rows, a short transaction at a time.

``dex-tasks prune --older-than 30d`` (:func:`prune`) deletes, with a cutoff of now minus the age:

* every terminal call that finished before the cutoff, with its events, its interrupt and its
  tool message (a single-attempt call that ran leaves a tombstone event under its key, so a
  replay under the same ids is refused rather than run again), except

  - an ``outcome_unknown`` call that no user message of its session names yet: reconciliation
    still needs it (the rule of ``transcript.py``: a call is reported once a user message names
    its key); once a report names it, it goes like any other;
  - a call whose turn still has a call that is not terminal: a queued user message waits for
    every turn begun before it, and the turn's first call is what says when it began
    (``store.deliver_ready_messages``);
  - a call of a durable turn that is still open (``dex_turns``): with its step it is the
    journal a restarted agent replays, so that the model is not asked again for a decision it
    made (asked again, a real model mints new call ids, and a write runs a second time under
    a new key);

* every user and assistant message created before the cutoff, unless its session has a call
  that is not terminal or a durable turn still open (a session waiting for a call, an approval
  that may outlast any retention period, or an agent to be restarted, keeps its whole
  conversation: the model reads it, and an open turn's steps are its journal, when the turn
  goes on), it is still ``queued``, or it names an ``outcome_unknown`` call still in the store
  (deleting that report would make the call look unreported again);
* every durable turn that ended before the cutoff and has no call left in the store;
* the LangGraph checkpoints (``DexCheckpointer``) of every thread whose session has nothing
  open (no call that is not terminal, no open turn): the whole thread, with its pending writes,
  when its newest checkpoint is older than the cutoff; otherwise its checkpoints older than the
  cutoff but the newest of each namespace and the ancestors that one's ``DeltaChannel``
  values are rebuilt from (LangGraph's ``keep_latest``).

Each batch is its own short transaction: the candidates are read first, without locks, then one
write transaction re-checks the conditions inside its DELETE statements and deletes at most
``batch`` calls (with their rows), messages, turns or threads' checkpoints. Terminal calls
never change again, so no worker ever waits for a row being deleted; on SQLite a batch holds
the database's write lock for a few milliseconds, which a worker's transaction waits out
(``busy_timeout``) rather than fails.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, delete, exists, or_, select, tuple_
from sqlalchemy.engine import Connection

from dex_tasks.errors import InvalidArgumentError
from dex_tasks.limits import key_part
from dex_tasks.policy import EffectClass
from dex_tasks.states import TERMINAL, CallStatus, MessageRole
from dex_tasks.store import APPROVALS, CALLS, EVENTS, INTERRUPTS, MESSAGES, WEBHOOKS, Store
from dex_tasks.store.checkpoints import (
    CHECKPOINTS,
    delete_checkpoints,
    keep_latest,
    row_ids,
    thread_rows,
)
from dex_tasks.store.journal import ENDED, OPEN
from dex_tasks.store.tables import INSERT_EVENT, PRUNED_EVENT, PRUNED_SESSION, TURNS
from dex_tasks.store.transcript import QUEUED, named_keys, names_key

log = logging.getLogger("dex_tasks.store.prune")

DEFAULT_BATCH = 1000

_AGE = re.compile(r"(\d+)([dhm])")
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60}
_OPEN = [s.value for s in CallStatus if not s.terminal]
_TERMINAL = sorted(s.value for s in TERMINAL)


AGE_RULE = ("must be a whole number of days, hours or minutes above zero, such as 30d, 12h "
            "or 90m")


def parse_age(text: str, option: str = "older_than") -> float:
    """Seconds in an age written ``30d``, ``12h`` or ``90m``; ``InvalidArgumentError`` naming
    ``option`` for anything else."""
    match = _AGE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or int(match[1]) == 0:
        raise InvalidArgumentError(f"{option} {AGE_RULE}; got {text!r}")
    return float(int(match[1]) * _UNIT_SECONDS[match[2]])


@dataclass
class PruneResult:
    """What one prune run deleted (and kept)."""

    cutoff: float
    """Epoch seconds: calls that finished, and messages created, before it were candidates."""
    calls: int = 0
    events: int = 0
    interrupts: int = 0
    tool_messages: int = 0
    messages: int = 0
    """User and assistant messages."""
    kept_unreported: int = 0
    """``outcome_unknown`` calls kept because no user message names them yet."""
    kept_open_turn: int = 0
    """Terminal calls kept because their turn is open (a durable turn not ended, or a call of
    the turn not terminal)."""
    turns: int = 0
    """Durable turns that had ended."""
    checkpoints: int = 0
    """LangGraph checkpoints (``DexCheckpointer``)."""
    checkpoint_writes: int = 0
    """Their pending writes."""
    batches: int = 0
    """Write transactions run."""
    longest_batch_seconds: float = 0.0
    tombstones: int = 0
    """Single-attempt calls that ran and were deleted, whose keys are kept so that a replay
    under the same ids is refused (``PrunedCallError``), never run again."""


def prune(store: Store, older_than: float, *, batch: int = DEFAULT_BATCH,
          now: float | None = None,
          on_pruned: Callable[[list[str]], None] | None = None) -> PruneResult:
    """Delete what finished (or was written) more than ``older_than`` seconds before ``now``
    (see the module docstring); at most ``batch`` calls or messages per transaction.

    ``on_pruned(keys)`` is given the single-attempt calls each batch deleted, after its
    commit (``dex-tasks prune`` deletes their Redis claims: their tombstones keep them from
    running again)."""
    if older_than <= 0:
        raise InvalidArgumentError(f"older_than must be above zero, got {older_than!r}")
    if batch < 1:
        raise InvalidArgumentError(f"batch must be at least 1, got {batch!r}")
    result = PruneResult(cutoff=(time.time() if now is None else now) - older_than)
    for status in _TERMINAL:
        _prune_calls(store, status, batch, result, on_pruned)
    _prune_messages(store, batch, result)
    _prune_turns(store, batch, result)
    _prune_checkpoints(store, batch, result)
    log.info("pruned", extra={"action": "prune", "cutoff": result.cutoff,
                              "calls": result.calls, "events": result.events,
                              "interrupts": result.interrupts,
                              "tool_messages": result.tool_messages,
                              "messages": result.messages, "batches": result.batches,
                              "kept_unreported": result.kept_unreported,
                              "kept_open_turn": result.kept_open_turn,
                              "turns": result.turns, "checkpoints": result.checkpoints,
                              "checkpoint_writes": result.checkpoint_writes})
    return result


# -- calls ----------------------------------------------------------------------------------------

_TURN = CALLS.alias("turn")
# Correlated to the call being deleted: another call of its turn that has not ended, or its
# durable turn, not ended either.
_TURN_OPEN = or_(
    exists().where(_TURN.c.session_id == CALLS.c.session_id,
                   _TURN.c.turn_id == CALLS.c.turn_id, _TURN.c.status.in_(_OPEN)),
    exists().where(TURNS.c.session_id == CALLS.c.session_id, TURNS.c.turn_id == CALLS.c.turn_id,
                   TURNS.c.status == OPEN),
)


def candidates(status: str, cutoff: float, after: tuple[float, str] | None,
               batch: int) -> Select[Any]:
    """The next page of ``status`` calls finished before ``cutoff``, oldest first, after the
    ``(finished_at, key)`` of the previous page: a range of the ``(status, finished_at)``
    index. Keyset paging: calls one page kept are not read again by the next."""
    page = select(CALLS.c.key, CALLS.c.session_id, CALLS.c.finished_at).where(
        CALLS.c.status == status, CALLS.c.finished_at < cutoff)
    if after is not None:
        page = page.where(tuple_(CALLS.c.finished_at, CALLS.c.key) > tuple_(*after))
    return page.order_by(CALLS.c.finished_at, CALLS.c.key).limit(batch)


def _prune_calls(store: Store, status: str, batch: int, result: PruneResult,
                 on_pruned: Callable[[list[str]], None] | None) -> None:
    """Page through :func:`candidates`; one write transaction per page."""
    after: tuple[float, str] | None = None
    while True:
        with store.read() as conn:
            rows = conn.execute(candidates(status, result.cutoff, after, batch)).all()
        if not rows:
            return
        after = (rows[-1].finished_at, rows[-1].key)
        pairs = [(row.session_id, row.key) for row in rows]
        with _batch(store, result) as conn:
            keys = [key for _, key in pairs]
            if status == CallStatus.OUTCOME_UNKNOWN.value:
                named = named_keys(conn, pairs)
                keys = [key for key in keys if key in named]
                result.kept_unreported += len(pairs) - len(keys)
            single = _delete_calls(conn, keys, result) if keys else []
        if single and on_pruned is not None:
            on_pruned(single)
        if len(rows) < batch:
            return


def _delete_calls(conn: Connection, keys: Sequence[str], result: PruneResult) -> list[str]:
    """Delete the calls ``keys`` still prunable, with their rows; returns the keys of the
    single-attempt calls among them (whose Redis claims can go now)."""
    rows = conn.execute(
        delete(CALLS)
        .where(CALLS.c.key.in_(keys), CALLS.c.status.in_(_TERMINAL),
               CALLS.c.finished_at < result.cutoff, ~_TURN_OPEN)
        .returning(CALLS.c.key, CALLS.c.effect, CALLS.c.attempts, CALLS.c.status)
    ).all()
    deleted = [row.key for row in rows]
    result.kept_open_turn += len(keys) - len(deleted)
    if not deleted:
        return []
    result.calls += len(deleted)
    result.events += _count(conn.execute(delete(EVENTS).where(
        EVENTS.c.key.in_(deleted), EVENTS.c.event != PRUNED_EVENT)))
    # A single-attempt call that ran leaves a tombstone: a replay under the same ids would
    # otherwise be a new call, and run again once its Redis claim is gone (or end "did not
    # run" although it ran while the claim lasts). One that never reached the tool needs none.
    single = [row for row in rows if not EffectClass(row.effect).retrying]
    ran = [row for row in single if row.attempts > 0]
    if ran:
        now = time.time()
        conn.execute(INSERT_EVENT, [
            {"session_id": PRUNED_SESSION, "key": row.key, "event": PRUNED_EVENT,
             "from_status": row.status, "to_status": row.status, "detail": None,
             "created_at": now} for row in ran])
        result.tombstones += len(ran)
    # An interrupt's approvals (several approvers) and the calls' webhook deliveries go with
    # them (counted with the interrupts and events they belong to: nothing new to report).
    conn.execute(delete(APPROVALS).where(APPROVALS.c.interrupt_id.in_(
        select(INTERRUPTS.c.interrupt_id).where(INTERRUPTS.c.key.in_(deleted)))))
    conn.execute(delete(WEBHOOKS).where(WEBHOOKS.c.key.in_(deleted)))
    result.interrupts += _count(conn.execute(
        delete(INTERRUPTS).where(INTERRUPTS.c.key.in_(deleted))))
    result.tool_messages += _count(conn.execute(
        delete(MESSAGES).where(MESSAGES.c.key.in_(deleted))))
    return [row.key for row in single]


# -- user and assistant messages ------------------------------------------------------------------

_SESSION_OPEN = or_(
    exists().where(CALLS.c.session_id == MESSAGES.c.session_id, CALLS.c.status.in_(_OPEN)),
    exists().where(TURNS.c.session_id == MESSAGES.c.session_id, TURNS.c.status == OPEN),
)


def _prune_messages(store: Store, batch: int, result: PruneResult) -> None:
    after = 0
    while True:
        with store.read() as conn:
            rows = conn.execute(
                select(MESSAGES.c.id, MESSAGES.c.session_id, MESSAGES.c.role, MESSAGES.c.text)
                .where(MESSAGES.c.id > after,
                       MESSAGES.c.role.in_([MessageRole.USER.value,
                                            MessageRole.ASSISTANT.value]),
                       MESSAGES.c.created_at < result.cutoff)
                .order_by(MESSAGES.c.id).limit(batch)
            ).all()
        if not rows:
            return
        after = rows[-1].id
        with _batch(store, result) as conn:
            unknown: dict[str, list[str]] = defaultdict(list)
            for session_id, key in conn.execute(
                select(CALLS.c.session_id, CALLS.c.key).where(
                    CALLS.c.session_id.in_({row.session_id for row in rows}),
                    CALLS.c.status == CallStatus.OUTCOME_UNKNOWN.value)):
                unknown[session_id].append(key)
            ids = [row.id for row in rows
                   if not any(names_key(row.text, key) for key in unknown[row.session_id])]
            if ids:
                result.messages += _count(conn.execute(
                    delete(MESSAGES).where(
                        MESSAGES.c.id.in_(ids),
                        or_(MESSAGES.c.status.is_(None), MESSAGES.c.status != QUEUED),
                        ~_SESSION_OPEN)))
        if len(rows) < batch:
            return


# -- durable turns --------------------------------------------------------------------------------


def turn_candidates(cutoff: float, after: tuple[float, str, str] | None,
                    batch: int) -> Select[Any]:
    """The next page of turns that ended before ``cutoff``, oldest first, after the
    ``(ended_at, session, turn)`` of the previous page: a range of ``(status, ended_at)``."""
    keys = tuple_(TURNS.c.ended_at, TURNS.c.session_id, TURNS.c.turn_id)
    page = select(TURNS.c.ended_at, TURNS.c.session_id, TURNS.c.turn_id).where(
        TURNS.c.status == ENDED, TURNS.c.ended_at < cutoff)
    if after is not None:
        page = page.where(keys > tuple_(*after))
    return page.order_by(*keys.clauses).limit(batch)


_CHECKPOINT_ORDER = tuple_(CHECKPOINTS.c.created_at, CHECKPOINTS.c.thread_id,
                           CHECKPOINTS.c.checkpoint_ns, CHECKPOINTS.c.checkpoint_id)


def checkpoint_candidates(cutoff: float, after: tuple[float, str, str, str] | None,
                          batch: int) -> Select[Any]:
    """The next page of LangGraph checkpoints older than ``cutoff``, oldest first, after the
    ``(created_at, thread, namespace, id)`` of the previous page: a range of the
    ``ix_dex_checkpoints_created`` index, in its order."""
    page = select(*_CHECKPOINT_ORDER.clauses).where(CHECKPOINTS.c.created_at < cutoff)
    if after is not None:
        page = page.where(_CHECKPOINT_ORDER > tuple_(*after))
    return page.order_by(*_CHECKPOINT_ORDER.clauses).limit(batch)


def _prune_turns(store: Store, batch: int, result: PruneResult) -> None:
    """Ended turns, oldest first (:func:`turn_candidates`), each once none of its calls is
    left (calls go first: a kept one, an unreported unknown outcome, keeps its turn)."""
    after: tuple[float, str, str] | None = None
    while True:
        with store.read() as conn:
            rows = conn.execute(turn_candidates(result.cutoff, after, batch)).all()
        if not rows:
            return
        after = tuple(rows[-1])  # type: ignore[assignment]
        with _batch(store, result) as conn:
            result.turns += _count(conn.execute(delete(TURNS).where(
                tuple_(TURNS.c.session_id, TURNS.c.turn_id).in_(
                    [(r.session_id, r.turn_id) for r in rows]),
                TURNS.c.status == ENDED, TURNS.c.ended_at < result.cutoff,
                ~exists().where(CALLS.c.session_id == TURNS.c.session_id,
                                CALLS.c.turn_id == TURNS.c.turn_id))))
        if len(rows) < batch:
            return


# -- LangGraph checkpoints ----------------------------------------------------------------------


def _prune_checkpoints(store: Store, batch: int, result: PruneResult) -> None:
    """The threads of each page of old checkpoints (:func:`checkpoint_candidates`), one
    transaction per page: each thread whole when it is idle, else trimmed to what
    ``keep_latest`` keeps; never a thread whose dex session (``key_part`` of the thread id,
    as ``DexMiddleware`` names it) has a call or a durable turn open."""
    after: tuple[float, str, str, str] | None = None
    while True:
        with store.read() as conn:
            page = conn.execute(checkpoint_candidates(result.cutoff, after, batch)).all()
        if not page:
            return
        after = tuple(page[-1])  # type: ignore[assignment]
        threads = sorted({row.thread_id for row in page})
        with _batch(store, result) as conn:
            idle = _idle_threads(conn, threads)
            doomed = []
            rows_of: dict[str, list[Any]] = defaultdict(list)
            for row in thread_rows(conn, idle) if idle else []:
                rows_of[row.thread_id].append(row)
            for rows in rows_of.values():
                if max(row.created_at for row in rows) < result.cutoff:
                    doomed += [row_ids(row) for row in rows]
                else:
                    kept = keep_latest(rows)
                    doomed += [row_ids(row) for row in rows
                               if row.created_at < result.cutoff and row_ids(row) not in kept]
            checkpoints, writes = delete_checkpoints(conn, doomed)
            result.checkpoints += checkpoints
            result.checkpoint_writes += writes
        if len(page) < batch:
            return


def _idle_threads(conn: Connection, threads: Sequence[str]) -> list[str]:
    """The threads whose dex session has no call that is not terminal and no open turn."""
    session_of = {thread: key_part(thread) for thread in threads}
    sessions = set(session_of.values())
    busy = set(conn.execute(select(CALLS.c.session_id).where(
        CALLS.c.session_id.in_(sessions), CALLS.c.status.in_(_OPEN))).scalars())
    busy |= set(conn.execute(select(TURNS.c.session_id).where(
        TURNS.c.session_id.in_(sessions), TURNS.c.status == OPEN)).scalars())
    return [thread for thread in threads if session_of[thread] not in busy]


# -- helpers --------------------------------------------------------------------------------------


@contextmanager
def _batch(store: Store, result: PruneResult) -> Iterator[Connection]:
    """One write transaction of a prune run, counted and timed."""
    started = time.monotonic()
    try:
        with store.write() as conn:
            yield conn
    finally:
        result.batches += 1
        result.longest_batch_seconds = max(result.longest_batch_seconds,
                                           time.monotonic() - started)


def _count(cursor: Any) -> int:
    return int(cursor.rowcount or 0)
