"""Claiming a call before its tool runs: on the single-attempt path the store's compare-and-set
claim (queued -> running) with the checks that need this worker (the tool is here, the
arguments are valid), behind the Redis claim in ``claims.py``; on the retrying path a lease in
Redis (``broker/runs.py``) after a read of the call, with no store write (DESIGN version 4)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis

from dex_tasks.broker.runs import BUSY, PendingStart
from dex_tasks.registry import InvalidArguments, get_local_tool
from dex_tasks.states import CallStatus
from dex_tasks.store.models import ToolCallRow, stored_call
from dex_tasks.worker.endings import (
    Attempt,
    end_unstarted,
    exhausted_before_claim,
    message_lost,
)
from dex_tasks.worker.runtime import Runtime
from dex_tasks.worker.task_states import Outcome

log = logging.getLogger("dex_tasks.worker.execution")


class _CannotRun(Exception):
    """The call cannot run here: any claim or start is undone and :meth:`end` ends the call
    (or, with no call, counts the delivery a duplicate)."""

    def __init__(self, why: str, call: ToolCallRow | None, *, exhausted: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.call = call
        self.exhausted = exhausted

    def end(self, rt: Runtime, key: str) -> Outcome | None:
        """End the call "did not run" (or as if its attempts ran out); None for a duplicate."""
        if self.call is None:
            log.info("duplicate delivery ignored", extra={"action": "duplicate_delivery",
                                                          "key": key})
            return None
        if self.exhausted:
            return exhausted_before_claim(rt, self.call, self.why)
        return end_unstarted(rt, self.call, self.why)


Claimed = tuple[ToolCallRow, Any, dict[str, Any]]


def claim(rt: Runtime, key: str, owner: str) -> Claimed | Outcome | None:
    """The store's compare-and-set claim, queued -> running, and the checks before a tool runs.

    One statement on the common path, and no read before it: the claim's UPDATE returns the
    whole call. A call that expired in the queue or has no attempt left is not claimed at all
    (the claim's own guards, ``store.moves.CLAIMABLE``): the claim returns nothing, and
    the call, read then, is ended "did not run" (or as if its attempts ran out) in a move of
    its own, guarded on its still being queued. The checks that need this worker (the tool is
    here, the arguments are valid for it) run on the row the claim returned; a call they
    refuse has its claim undone (rolled back, or on PostgreSQL moved back to ``queued`` with
    its attempt uncounted) and is ended likewise: the :class:`Outcome` of that is returned.
    Otherwise the call as claimed (``attempts`` is this attempt's number), the tool and the
    validated arguments; None for a call that was not queued (a duplicate delivery, a call
    that ended).
    """
    now = time.time()

    def vet(row: Any) -> tuple[Any, dict[str, Any]]:
        tool = get_local_tool(row.tool)
        if tool is None:
            raise _CannotRun(f"no worker that took it has the tool {row.tool!r}",
                             _before_claim(row))
        try:
            return tool, tool.recorded_arguments(json.loads(row.arguments))
        except InvalidArguments as err:
            raise _CannotRun(str(err), _before_claim(row)) from None

    try:
        claimed = rt.store.claim(key, owner, rt.settings.lease_seconds, vet, now=now)
    except _CannotRun as refused:
        return refused.end(rt, key)
    if claimed is None:
        return _not_claimed(rt, key, now)
    row, (tool, arguments) = claimed
    return cast(ToolCallRow, row), tool, arguments


def _not_claimed(rt: Runtime, key: str, now: float) -> Outcome | None:
    """A delivery whose claim matched nothing: the call is not queued (another delivery owns
    it, or it ended), or the claim's guards refused it. ``now`` is the claim's: a call read
    after it must be judged as the claim judged it."""
    call = rt.store.get_call(key)
    if call is not None and call.status == CallStatus.QUEUED.value:
        if call.expires_at is not None and now > call.expires_at:
            return end_unstarted(rt, call, "it expired in the queue before a worker started it")
        if call.attempts >= call.max_attempts:
            return exhausted_before_claim(
                rt, call, f"the worker was lost during each of the {call.attempts} attempts")
    # Another delivery owns it, or it is finished: a duplicate changes nothing.
    log.info("duplicate delivery ignored", extra={"action": "duplicate_delivery", "key": key})
    return None


def _before_claim(row: Any) -> ToolCallRow:
    """The call as it was before the claim that returned ``row`` (which is rolled back)."""
    return ToolCallRow.model_validate({
        **row._mapping, "status": CallStatus.QUEUED.value, "attempts": row.attempts - 1,
        "worker": None, "lease_expires_at": None, "prev_status": None})


Leased = tuple[ToolCallRow, Any, dict[str, Any], Attempt]

# The statuses as the store's rows hold them (plain text; an enum's ``.value`` is a Python-level
# property, read on every delivery).
_QUEUED = CallStatus.QUEUED.value
_RUNNING = CallStatus.RUNNING.value

# The effect class and most attempts of each tool whose queued call this process has read: the
# start of an attempt sent before its call is read names the effect in the run (``/metrics``
# counts running attempts by tool and effect) and starts no attempt past the most, and is
# taken back if the call says otherwise.
_SEEN: dict[str, tuple[str, int]] = {}


def claim_leased(rt: Runtime, key: str, owner: str,
                 tool: str | None = None) -> Leased | Outcome | None:
    """Start an attempt of a retrying call: its run leased in Redis, nothing written to the
    store (which still says ``queued``; the ending records the start).

    The call is read first: one that is not queued is a duplicate delivery (None); one that
    expired in the queue, whose tool is not here or whose arguments are invalid ends "did not
    run" (its :class:`Outcome`), as the store's claim decides on the other path. Then
    ``Runs.start`` counts the attempt and takes the lease in one command: another live lease on
    the call makes this delivery a duplicate, and a call with no attempt left ends as its
    effect class says. Returns the call as it now runs (status ``running``, ``attempts`` this
    attempt's number), its tool, the validated arguments and the :class:`Attempt`. Redis
    unreachable: the call is marked unsent (the republisher sends it again) and this delivery
    changes nothing.

    ``tool``: the tool the message says it runs. Once this process has read a call of that
    tool (and so knows its effect class and most attempts), the start is sent before the call
    is read, and its reply read after: the two round trips overlap. It is kept only if it is
    exactly the start the steps above would have made (the call queued, unexpired, of that
    tool and effect, its stored count not above Redis's, an attempt left, its arguments
    valid); otherwise it is taken back (``Runs.undo_start``) and the steps above decide, on
    the call as read.
    """
    now = time.time()
    seen = _SEEN.get(tool) if tool is not None else None
    effect = seen[0] if seen is not None else None
    pending: PendingStart | None = None
    if tool is not None and seen is not None:
        try:
            pending = rt.runs.start_later(
                key, owner, max_attempts=seen[1], lease_seconds=rt.settings.lease_seconds,
                started=now, ttl=rt.settings.claim_ttl_seconds, tool=tool, effect=seen[0])
        except redis.RedisError:
            pending = None  # not sent, so it did not run: the steps above try again
    try:
        # The call's columns, not a ToolCallRow: the checks read a handful of them, and only
        # the call as it runs (or as it ends, when it cannot run) is built as a model, once
        # (a table model's copy and each of its attribute reads go through SQLAlchemy's
        # instrumentation, about 10 µs a delivery for a row built only to be copied).
        call = rt.store.get_call_columns(key)
    except BaseException:
        if pending is not None:
            _take_back(rt, key, owner, pending)
        raise
    if call is not None and call["status"] == _QUEUED:
        _SEEN[call["tool"]] = (call["effect"], call["max_attempts"])
    if pending is None:
        return _start(rt, key, owner, call, now)
    try:
        number = pending.number()
    except redis.RedisError:
        # Its reply was lost: it may have run. As a start that failed, once the call is
        # checked (a lease left behind lapses; the reaper then finds what became of the call).
        return _start(rt, key, owner, call, now, start_failed=True)
    if number is None or number == BUSY:
        # Not run (Redis had to load the script, or counted every attempt), or another attempt
        # holds the call: the steps above, whose own start says so again.
        return _start(rt, key, owner, call, now)
    return _start(rt, key, owner, call, now, early=_Early(number, tool, effect))


@dataclass(frozen=True)
class _Early:
    """An attempt started before its call was read: its number, and the tool and effect of the
    call it was started for."""

    number: int
    tool: str | None
    effect: str | None

    def fits(self, call: Mapping[str, Any]) -> bool:
        """Whether it is exactly the start :func:`_start` would make for ``call`` (the columns
        of a call already checked: queued, unexpired, an attempt left, its arguments
        valid)."""
        return bool(call["tool"] == self.tool and call["effect"] == self.effect
                    and call["attempts"] < self.number <= call["max_attempts"])


def _undo(rt: Runtime, key: str, owner: str, number: int) -> None:
    """Take back an attempt this delivery started and did not run (most often one started
    before its call was read). Redis failing here leaves the run to lapse with its lease (the
    reaper then finds what became of its call)."""
    try:
        rt.runs.undo_start(key, owner, number, ttl=rt.settings.claim_ttl_seconds)
    except redis.RedisError as err:
        log.warning("an attempt started before its call was read was not taken back; its "
                    "lease lapses", extra={"action": "run_undo_failed", "key": key,
                                           "error": str(err)[:200]})


def _take_back(rt: Runtime, key: str, owner: str, pending: PendingStart) -> None:
    """The call's read failed: take back the start sent before it, if it ran."""
    try:
        number = pending.number()
    except redis.RedisError:
        return  # it may have run: its lease lapses
    if number is not None and number > 0:
        _undo(rt, key, owner, number)


def _checked(call: Mapping[str, Any] | None,
             now: float) -> tuple[Mapping[str, Any], Any, dict[str, Any]]:
    """The checks before a queued call's attempt starts, on its columns as read: the columns,
    its tool and its validated arguments; :class:`_CannotRun` for a call that is not queued
    (a duplicate delivery) or must end "did not run" (or as if its attempts ran out)."""
    if call is None or call["status"] != _QUEUED:
        raise _CannotRun("not queued", None)
    expires_at = call["expires_at"]
    if expires_at is not None and now > expires_at:
        raise _CannotRun("it expired in the queue before a worker started it",
                         stored_call(call))
    attempts = call["attempts"]
    if attempts >= call["max_attempts"]:
        raise _CannotRun(f"the worker was lost during each of the {attempts} attempts",
                         stored_call(call), exhausted=True)
    name = call["tool"]
    tool = get_local_tool(name)
    if tool is None:
        raise _CannotRun(f"no worker that took it has the tool {name!r}", stored_call(call))
    try:
        return call, tool, tool.validate(json.loads(call["arguments"]))
    except InvalidArguments as err:
        raise _CannotRun(str(err), stored_call(call)) from None


def _start(rt: Runtime, key: str, owner: str, call: Mapping[str, Any] | None, now: float, *,
           early: _Early | None = None, start_failed: bool = False) -> Leased | Outcome | None:
    """:func:`claim_leased`'s steps on the call's columns as read (None: no such call), which
    are built into a :class:`ToolCallRow` once, as the call runs (or as it is when it cannot
    run). ``early``: an attempt started before
    the read, kept if it :meth:`~_Early.fits` the call and otherwise taken back before
    anything else (a call that cannot run, or a check that fails unexpectedly, leaves no
    lease for the reaper to count as a lost attempt). ``start_failed``: the start was sent and
    its reply lost, which counts as ``Runs.start`` failing."""
    try:
        call, tool, arguments = _checked(call, now)
    except BaseException as refused:
        if early is not None:
            _undo(rt, key, owner, early.number)
        if isinstance(refused, _CannotRun):
            return refused.end(rt, key)
        raise
    if early is not None and not early.fits(call):
        _undo(rt, key, owner, early.number)
        early = None
    if start_failed:
        message_lost(rt, key, "run_start_failed")
        return None
    stored = call["attempts"]
    if early is not None:
        number = early.number
    else:
        try:
            number, counted = rt.runs.start(
                key, owner, stored_attempts=stored, max_attempts=call["max_attempts"],
                lease_seconds=rt.settings.lease_seconds, started=now,
                ttl=rt.settings.claim_ttl_seconds, tool=call["tool"], effect=call["effect"])
        except redis.RedisError:
            message_lost(rt, key, "run_start_failed")
            return None
        if number == BUSY:
            log.info("duplicate delivery ignored (another attempt runs)",
                     extra={"action": "duplicate_delivery", "key": key})
            return None
        if number == 0:
            return exhausted_before_claim(
                rt, stored_call(call),
                f"the worker was lost during each of the {counted} attempts", counted)
    try:
        running = stored_call({**call, "status": _RUNNING, "attempts": number, "worker": owner})
    except BaseException:
        # A row the model refuses (the checks read only its columns): nothing ran, and no
        # lease is left for the reaper to count as a lost attempt.
        _undo(rt, key, owner, number)
        raise
    return running, tool, arguments, Attempt(owner, number, stored=stored, started=now)
