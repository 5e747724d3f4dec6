"""Pure retry decisions: what happens to a call after an error or a lost worker.

No broker, no store: the Celery tasks and the sweeps act on what these functions return, and
the unit tests call them directly. :func:`celery_retry_options` says the same rules in Celery's
own vocabulary, for the task kinds' declarations.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from dex_tasks.errors import TransientToolError
from dex_tasks.policy import EffectClass
from dex_tasks.states import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus


@dataclass(frozen=True)
class Decision:
    """Either retry after ``delay`` seconds, or end the call in ``status`` with ``error``."""

    retry: bool
    delay: float = 0.0
    status: CallStatus | None = None
    error: str | None = None


def backoff(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Delay before attempt ``attempt + 1``: exponential, capped, with "equal jitter".

    Half the delay is fixed and half is random, so retries of many calls that failed together
    spread out, yet no retry comes back immediately.
    """
    rng = rng or random.Random()
    ceiling = min(cap, base * (2 ** max(0, attempt - 1)))
    return float(ceiling / 2 + rng.uniform(0, ceiling / 2))


def after_transient_error(
    effect: EffectClass,
    attempt: int,
    max_attempts: int,
    message: str,
    *,
    base: float,
    cap: float,
    retry_after: float | None = None,
    rng: random.Random | None = None,
) -> Decision:
    """A tool raised ``TransientToolError`` (or hit its soft time limit) on attempt ``attempt``.

    ``retry_after``, the tool's own hint, replaces the computed backoff within bounds (see
    :func:`bounded_retry_after`).
    """
    if effect.retrying and attempt < max_attempts:
        hinted = bounded_retry_after(retry_after, cap)
        delay = hinted if hinted is not None else backoff(attempt, base, cap, rng)
        return Decision(retry=True, delay=delay)
    if effect.retrying:
        return Decision(
            retry=False,
            status=CallStatus.FAILED,
            error=f"the tool failed on all {max_attempts} attempts; last error: {message}",
        )
    return Decision(retry=False, status=CallStatus.FAILED, error=message)


def bounded_retry_after(retry_after: Any, cap: float) -> float | None:
    """A tool's ``retry_after`` hint as a usable delay: within ``[0, cap]``, or None for none.

    The hint comes from a remote service and is trusted only so far. Above the backoff cap
    (``inf`` and ``1e300`` included) it is cut to the cap: a call must come back within the
    cap like any other retry, never wait for ever. Below zero it means "no need to wait": 0.
    ``nan``, or anything that is not a number, says nothing, so the computed backoff applies
    (None).
    """
    if retry_after is None or isinstance(retry_after, bool):
        return None
    try:
        value = float(retry_after)
    except (TypeError, ValueError, OverflowError):
        return None
    if math.isnan(value):
        return None
    return min(max(value, 0.0), max(cap, 0.0))


def after_worker_lost(
    effect: EffectClass, attempts_used: int, max_attempts: int, reason: str, *, key: str
) -> Decision:
    """The attempt's worker died, was killed, or its hard time limit struck.

    The tool may have run part or all of the way. A retrying call goes again while attempts
    remain. When they run out, a read has no effect to be unsure about, so it is ``failed``;
    any write is ``outcome_unknown``. A single-attempt call is ``outcome_unknown`` at once.
    """
    if effect.retrying and attempts_used < max_attempts:
        return Decision(retry=True)
    if effect is EffectClass.READ:
        return Decision(
            retry=False,
            status=CallStatus.FAILED,
            error=f"the tool could not finish in {attempts_used} attempts: {reason}",
        )
    return Decision(retry=False, status=CallStatus.OUTCOME_UNKNOWN,
                    error=outcome_unknown_text(reason, key))


def outcome_unknown_text(reason: str, key: str) -> str:
    """The error of an ``outcome_unknown`` call, which the model reads: why, and what now.

    It names the call's idempotency key, so that the model (or whoever reads the transcript)
    can ask the service about that very call.
    """
    return (
        f"{OUTCOME_UNKNOWN_TOOL_RESULT}: {reason}. The tool may or may not have taken "
        "effect; it will not be run again. Check with the service using the call's "
        f"idempotency key {key!r}."
    )


def celery_retry_options(
    retrying: bool, *, base: float, cap: float, max_attempts: int
) -> dict[str, Any]:
    """The retry settings a task kind declares to Celery: the retrying kind (the effect classes
    whose ``EffectClass.retrying`` is true) or the single-attempt kind.

    The retrying kind declares ``autoretry_for=(TransientToolError,)`` with the backoff of
    ``DEX_RETRY_BACKOFF_BASE_SECONDS`` / ``_MAX_SECONDS`` and jitter, and
    ``max_retries = max_attempts - 1`` for calls whose policy sets no attempts. These are the
    kind's defaults, readable where Celery keeps them (``app.tasks[name]``). Each call's own
    values come from its policy snapshot in the store and are passed per retry
    (``Task.retry(countdown=..., max_retries=...)``): see ``execution.report``. The
    single-attempt kind declares no retry at all.
    """
    if not retrying:
        return {"autoretry_for": (), "max_retries": 0}
    return {
        "autoretry_for": (TransientToolError,),
        "retry_backoff": base,
        "retry_backoff_max": cap,
        "retry_jitter": True,
        "max_retries": max(0, max_attempts - 1),
    }
