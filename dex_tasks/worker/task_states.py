"""What Celery is told about each delivery of a call: the state Flower and ``celery events`` show.

The store is the record of every call; Celery keeps a state per message, which monitors show.
The task bodies (``execution.py``) record each outcome in the store first and then hand it to
:func:`report`, which makes Celery's state agree with it:

===============================  ==========================================================
what the delivery did             Celery state (event)
===============================  ==========================================================
call ``succeeded``                ``SUCCESS`` (``task-succeeded``, no result: results stay
                                  in the store, which may hold private data)
call ``failed``                   ``FAILURE`` (``task-failed``, :class:`CallFailed` with the
                                  call's error)
call ``outcome_unknown``          ``FAILURE`` (:class:`CallOutcomeUnknown`, error text starting
                                  ``OUTCOME_UNKNOWN_TOOL_RESULT``)
call queued for a retry           ``RETRY`` (``task-retried``, through ``Task.retry``)
nothing (a duplicate delivery)    ``IGNORED`` (a ``task-ignored`` event, then ``Ignore``)
===============================  ==========================================================

A message never carries the call's arguments (only its key), and no state or event here does
either.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from dex_tasks.errors import CallFailed, CallFailure, CallOutcomeUnknown
from dex_tasks.states import CallStatus
from dex_tasks.store.models import ToolCallRow

log = logging.getLogger("dex_tasks.worker.task_states")


@dataclass(frozen=True)
class Outcome:
    """What one delivery did to its call; it decides the state Celery reports for the message.

    ``status`` is what this delivery moved the call to (``None``: it changed nothing, ``why``
    says why); a retry is ``QUEUED`` with the countdown ``retry_in`` and the error ``cause``
    that asked for it.
    """

    status: CallStatus | None
    error: str | None = None
    retry_in: float = 0.0
    cause: BaseException | None = None
    why: str = ""


def failure(status: CallStatus, error: str | None) -> CallFailure:
    """The exception that makes Celery report ``FAILURE`` for a call that ended ``status``."""
    text = error or status.value
    return CallOutcomeUnknown(text) if status is CallStatus.OUTCOME_UNKNOWN else CallFailed(text)


def report(task: Task, call: ToolCallRow, outcome: Outcome) -> None:
    """Tell Celery what the delivery did, after the store has recorded it.

    * ``succeeded``: return, so Celery says ``SUCCESS`` (with no result: results stay in the
      store, which may hold private data).
    * ``failed`` / ``outcome_unknown``: raise :class:`CallFailed` / :class:`CallOutcomeUnknown`
      with the call's error, so Celery says ``FAILURE`` and emits ``task-failed``.
    * a retry: ``Task.retry`` with the call's own countdown and ``max_retries`` from its policy
      snapshot, so Celery says ``RETRY``, emits ``task-retried``, and sends the next message
      with the same task id, name, time limits and expiry.
    * nothing (a duplicate delivery, or an attempt overtaken by a sweep): a ``task-ignored``
      event and Celery's ``Ignore``; monitors show the state ``IGNORED``.
    """
    if outcome.status is CallStatus.SUCCEEDED:
        return
    if outcome.status is None:
        raise ignored(task, call.key, outcome.why)
    if outcome.status is CallStatus.QUEUED:
        raise _retry(task, call, outcome)
    raise failure(outcome.status, outcome.error)


def _retry(task: Task, call: ToolCallRow, outcome: Outcome) -> Retry:
    """Send the next attempt through Celery's ``Task.retry``; the store already says queued.

    ``max_retries`` is the call's (``max_attempts - 1``). Celery counts retries per message
    and restarts at 0 on a republished one, so its count never exceeds the attempts the store
    counted: the store's decision to retry is never refused here. If the message cannot be
    sent, Celery's ``Reject`` is turned back into a plain ``Retry``: the store has the call
    queued with its due time, and the republisher sends it.
    """
    try:
        return task.retry(exc=outcome.cause, countdown=outcome.retry_in,
                          max_retries=max(0, call.max_attempts - 1), throw=False)
    except Reject:
        log.warning("retry publish failed; the republisher will send it",
                    extra={"action": "republish_failed", "key": call.key})
        return Retry(exc=outcome.cause, when=outcome.retry_in)
    finally:
        # Task.retry leaves a per-call max_retries on the shared task object for Celery's
        # autoretry wrapper; it is this call's, not the next one's.
        task.__dict__.pop("override_max_retries", None)


def ignored(task: Task, key: str | None, why: str) -> Ignore:
    """Celery's ``Ignore`` for a delivery that changed nothing, after a ``task-ignored`` event.

    ``Ignore`` alone would leave monitors showing the message ``STARTED`` for ever (Celery sends
    no event for it); the custom event gives it the state ``IGNORED`` in Flower and
    ``celery events``. Best effort: an event that cannot be sent is not worth a failure.
    """
    if task.app.conf.worker_send_task_events and task.send_events:
        try:
            task.send_event("task-ignored", retry=False, reason=why)
        except Exception:  # noqa: BLE001 - monitoring only
            log.debug("task-ignored event not sent", extra={"action": "event_failed",
                                                            "key": key})
    return Ignore(why)
