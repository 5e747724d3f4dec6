"""Pure retry decisions: what happens to a call after an error or a lost worker.

No broker, no store: the Celery tasks and the sweeps act on what these functions return, and
the unit tests call them directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
    """A tool raised ``TransientToolError`` (or hit its soft time limit) on attempt ``attempt``."""
    if effect.retrying and attempt < max_attempts:
        delay = retry_after if retry_after is not None else backoff(attempt, base, cap, rng)
        return Decision(retry=True, delay=max(0.0, delay))
    if effect.retrying:
        return Decision(
            retry=False,
            status=CallStatus.FAILED,
            error=f"the tool failed on all {max_attempts} attempts; last error: {message}",
        )
    return Decision(retry=False, status=CallStatus.FAILED, error=message)


def after_worker_lost(
    effect: EffectClass, attempts_used: int, max_attempts: int, reason: str
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
                    error=outcome_unknown_text(reason))


def outcome_unknown_text(reason: str) -> str:
    """The error of an ``outcome_unknown`` call, which the model reads: why, and what now."""
    return (
        f"{OUTCOME_UNKNOWN_TOOL_RESULT}: {reason}. The tool may or may not have taken "
        "effect; it will not be run again. Check with the service using the call's "
        "idempotency key."
    )
