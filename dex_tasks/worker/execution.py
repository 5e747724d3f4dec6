"""The bodies of the two task kinds.

Retrying path (``read``, ``idempotent_write``): acknowledged late; a lost child's message is
requeued by Celery (``reject_on_worker_lost``). Celery puts no cap on that, so every attempt
is counted (in Redis, with its lease: ``claiming.claim_leased``; the store is written only
when the call ends or an attempt is recorded lost or retried) and a delivery past
``max_attempts`` ends the call instead.

Single-attempt path (``non_idempotent_write``, ``unclassified``): acknowledged early; a Redis
``SET NX`` claim turns duplicate deliveries away cheaply, and the store's compare-and-set claim
decides. Once a call is ``running`` it is never run again: a lost child or a hard time limit
ends it ``outcome_unknown``.

A child that is killed runs none of its own hooks, so the worker's main process handles the
loss (``main_process.DexRequest``, calling ``endings.handle_lost_attempt``). A whole worker that
dies runs nothing at all; its leases stop being renewed and the reaper in ``sweeps.py``
(and ``leased.py`` for the retrying path's leases in Redis) finishes the job.

Each body records its outcome in the store first and then tells Celery
(``task_states.report``), so that Celery's own state for the message (what Flower and
``celery events`` show) agrees with the call.

The roles live in their own modules: ``runtime.py`` (the process's connections, owner ids),
``claiming.py`` (the claims), ``attempts.py`` (running the tool once), ``endings.py`` (recording
endings, calls that cannot start, lost attempts). This module holds the two task bodies.
"""

from __future__ import annotations

import logging

import redis
from celery import Task

from dex_tasks.broker.celery_app import tool_of_shadow
from dex_tasks.worker import claims
from dex_tasks.worker import spans as worker_spans
from dex_tasks.worker.attempts import run_attempt
from dex_tasks.worker.claiming import claim, claim_leased
from dex_tasks.worker.endings import DUPLICATE, RACED, Attempt, message_lost
from dex_tasks.worker.runtime import (
    Runtime,
    current_owner,
    owner_id,
    reset_runtime,
    runtime,
)
from dex_tasks.worker.task_states import Outcome, failure, ignored, report

__all__ = ["Runtime", "current_owner", "owner_id", "reset_runtime", "run_retrying",
           "run_single_attempt", "runtime"]

log = logging.getLogger("dex_tasks.worker.execution")


# -- the task bodies ----------------------------------------------------------------------------


def run_retrying(task: Task, key: str) -> None:
    """Body of the retrying task kind."""
    rt = runtime(task.app)
    request = task.request
    owner = current_owner(request.hostname)
    leased = claim_leased(rt, key, owner, tool_of_shadow(request.shadow))
    worker_spans.claimed(leased)
    if not isinstance(leased, tuple):
        _report_unclaimed(task, key, leased)
        return
    call, tool, arguments, attempt = leased
    outcome = run_attempt(rt, call, tool, arguments, attempt, retrying=True)
    worker_spans.ended(outcome)
    report(task, call, outcome)


def _claim_and_run(task: Task, rt: Runtime, key: str, owner: str) -> None:
    """Claim a single-attempt call in the store, run it, and tell Celery how it ended."""
    claimed = claim(rt, key, owner)
    worker_spans.claimed(claimed)
    if not isinstance(claimed, tuple):
        if claimed is None:
            # A late duplicate of an ended call took a fresh Redis claim (the ended call's
            # had run out): it is worth no more than the ended call's own.
            claims.shorten(rt.redis, key, rt.settings.claim_ended_ttl_seconds)
        _report_unclaimed(task, key, claimed)
        return
    call, tool, arguments = claimed
    outcome = run_attempt(rt, call, tool, arguments, Attempt(owner, call.attempts),
                          retrying=False)
    worker_spans.ended(outcome)
    report(task, call, outcome)


def _report_unclaimed(task: Task, key: str, outcome: Outcome | None) -> None:
    """Tell Celery about a delivery that ran no tool: it ended the call here (FAILURE), or it
    changed nothing (IGNORED)."""
    if outcome is None or outcome.status is None:
        raise ignored(task, key, DUPLICATE if outcome is None else (outcome.why or RACED))
    raise failure(outcome.status, outcome.error)



def run_single_attempt(task: Task, key: str) -> None:
    """Body of the single-attempt task kind."""
    rt = runtime(task.app)
    owner = current_owner(task.request.hostname)
    # The Redis claim first: it turns a duplicate away without a store round trip. A worker
    # that dies between the two claims leaves the call queued, untouched by any tool, behind
    # a claim the republisher recognises as dead ("did not run").
    try:
        first = claims.try_claim(rt.redis, key, owner, rt.settings.claim_ttl_seconds,
                                 retry_seconds=rt.settings.claim_retry_seconds)
    except redis.RedisError as err:
        # The message is acknowledged and no tool ran: the republisher sends the call again
        # as soon as Redis answers, not a whole window later (issue 19, P2).
        message_lost(rt, key, "claim_failed")
        raise ignored(task, key, f"the Redis claim failed ({type(err).__name__}: {err}); "
                                 "the call stays queued and is sent again") from err
    if not first:
        log.info("claim taken, duplicate ignored", extra={"action": "duplicate_delivery",
                                                          "key": key})
        raise ignored(task, key, DUPLICATE)
    _claim_and_run(task, rt, key, owner)

