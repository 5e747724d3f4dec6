"""The retrying path: the pure retry decisions, then the same rules end to end on a real worker.

Guarantee 3: transient errors are retried with exponential backoff and jitter up to max
attempts; a non-transient error ends the call at once with the tool's message; worker losses
use up attempts, after which a read is ``failed`` and a write ``outcome_unknown``.
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

import pytest
import redis

from dex_tasks import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, DexClient, DexSettings, EffectClass
from dex_tasks.broker.routing import queue_for
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.retry import after_transient_error, after_worker_lost, backoff
from dex_tasks.worker.sweeps import republish_stranded
from tests.conftest import StartWorker
from tests.helpers import started_pid, wait_until
from workers import ledger

# -- pure decisions ------------------------------------------------------------------------------


def test_backoff_doubles_per_attempt_with_equal_jitter() -> None:
    rng = random.Random(7)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0)]:
        delays = [backoff(attempt, base=1.0, cap=100.0, rng=rng) for _ in range(200)]
        # Half fixed, half random: never immediate, never above the exponential ceiling.
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        # Jitter spreads calls that failed together.
        assert max(delays) - min(delays) > ceiling / 4


def test_backoff_is_capped_and_handles_attempt_zero() -> None:
    rng = random.Random(1)
    assert all(5.0 <= backoff(30, base=1.0, cap=10.0, rng=rng) <= 10.0 for _ in range(50))
    assert 0.5 <= backoff(0, base=1.0, cap=10.0, rng=rng) <= 1.0
    assert backoff(3, base=0.0, cap=10.0) == 0.0


@pytest.mark.parametrize("effect", [EffectClass.READ, EffectClass.IDEMPOTENT_WRITE])
def test_transient_error_retries_while_attempts_remain(effect: EffectClass) -> None:
    rng = random.Random(3)
    decision = after_transient_error(effect, 1, 3, "busy", base=2.0, cap=60.0, rng=rng)
    assert decision.retry and 1.0 <= decision.delay <= 2.0
    assert decision.status is None
    last = after_transient_error(effect, 3, 3, "busy", base=2.0, cap=60.0)
    assert not last.retry
    assert last.status is CallStatus.FAILED
    assert last.error == "the tool failed on all 3 attempts; last error: busy"


def test_transient_error_honours_retry_after_but_not_below_zero() -> None:
    decision = after_transient_error(EffectClass.READ, 1, 3, "x", base=1.0, cap=60.0,
                                     retry_after=12.5)
    assert decision.delay == 12.5
    # Never above the backoff cap (issue 11.9; tests/test_tool_exceptions.py has the edges).
    assert after_transient_error(EffectClass.READ, 1, 3, "x", base=1.0, cap=1.0,
                                 retry_after=12.5).delay == 1.0
    assert after_transient_error(EffectClass.READ, 1, 3, "x", base=1.0, cap=1.0,
                                 retry_after=-4).delay == 0.0


@pytest.mark.parametrize("effect", [EffectClass.NON_IDEMPOTENT_WRITE, EffectClass.UNCLASSIFIED])
def test_transient_error_on_single_attempt_path_fails_at_once(effect: EffectClass) -> None:
    decision = after_transient_error(effect, 1, 5, "busy", base=1.0, cap=1.0)
    assert not decision.retry
    assert decision.status is CallStatus.FAILED
    assert decision.error == "busy"


@pytest.mark.parametrize(
    ("effect", "used", "maximum", "status"),
    [
        (EffectClass.READ, 1, 3, None),
        (EffectClass.IDEMPOTENT_WRITE, 2, 3, None),
        (EffectClass.READ, 3, 3, CallStatus.FAILED),
        (EffectClass.IDEMPOTENT_WRITE, 3, 3, CallStatus.OUTCOME_UNKNOWN),
        (EffectClass.NON_IDEMPOTENT_WRITE, 1, 1, CallStatus.OUTCOME_UNKNOWN),
        (EffectClass.UNCLASSIFIED, 1, 1, CallStatus.OUTCOME_UNKNOWN),
        # A single-attempt call is never retried, even if a row claimed more attempts.
        (EffectClass.NON_IDEMPOTENT_WRITE, 1, 4, CallStatus.OUTCOME_UNKNOWN),
    ],
)
def test_after_worker_lost(effect: EffectClass, used: int, maximum: int,
                           status: CallStatus | None) -> None:
    decision = after_worker_lost(effect, used, maximum, "child killed", key="s/t/c-1")
    assert decision.retry is (status is None)
    assert decision.status is status
    if status is CallStatus.OUTCOME_UNKNOWN:
        assert decision.error is not None
        assert decision.error.startswith(f"{OUTCOME_UNKNOWN_TOOL_RESULT}: child killed")
        # The model is told which key to check with the service (issue 18).
        assert "idempotency key 's/t/c-1'" in decision.error
    if status is CallStatus.FAILED:
        assert decision.error is not None and "child killed" in decision.error


# -- the retrying path on a real worker ------------------------------------------------------------


def test_retrying_path_follows_the_decisions_on_a_real_worker(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given one worker, a read that fails transiently twice, a read that always fails
    # transiently (4 attempts allowed), and a read that raises a non-transient error
    worker = start_worker(concurrency=2)
    flaky = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="flaky",
                             tool="flaky_lookup", arguments={"order_id": "1001", "fail_times": 2})
    hopeless = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="hopeless",
                                tool="flaky_lookup",
                                arguments={"order_id": "1001", "fail_times": 99})
    broken = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="broken",
                              tool="broken_report", arguments={"report": "q3"})

    # Then the flaky read succeeds on its third attempt, after backing off between attempts
    done = client.wait(flaky.key, timeout=30)
    assert done.status is CallStatus.SUCCEEDED
    assert done.result == {"order_id": "1001", "attempt": 3}
    assert done.attempts == 3 and done.error is None
    retries = [e for e in client.store.events_for_call(flaky.key)
               if e.detail and '"transient_error"' in e.detail]
    assert [(e.from_status, e.to_status) for e in retries] == [("running", "queued")] * 2
    runs = sorted((e for e in ledger.read(ledger_path) if e["key"] == flaky.key),
                  key=lambda e: e["attempt"])
    assert [e["attempt"] for e in runs] == [1, 2, 3]
    settings = client.settings
    for attempt, (before, after) in enumerate(itertools.pairwise(runs), start=1):
        ceiling = min(settings.retry_backoff_max_seconds,
                      settings.retry_backoff_base_seconds * 2 ** (attempt - 1))
        # The retry waited at least the jittered delay, which is at least half the ceiling.
        assert after["at"] - before["at"] >= ceiling / 2 * 0.9

    # And transient errors beyond max attempts end failed after exactly max attempts
    gave_up = client.wait(hopeless.key, timeout=30)
    assert gave_up.status is CallStatus.FAILED
    assert gave_up.attempts == 4
    assert gave_up.error == ("the tool failed on all 4 attempts; last error: "
                             "TransientToolError: order service busy (attempt 4)")
    assert ledger.executions(ledger_path)[hopeless.key] == 4

    # And a non-transient error fails at once with the tool's own message, never retried
    failed = client.wait(broken.key, timeout=30)
    assert failed.status is CallStatus.FAILED
    assert failed.attempts == 1
    assert failed.error == "ValueError: report 'q3' does not exist"
    assert ledger.executions(ledger_path)[broken.key] == 1
    worker.kill_all()


def test_a_retry_waiting_out_its_countdown_is_not_stranded(
    settings: DexSettings, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a worker whose retries may wait up to 4 s, longer than the republish window (2 s)
    slow = settings.model_copy(update={"retry_backoff_max_seconds": 4.0})
    start_worker(concurrency=1, tools="workers.example_tools,tests.edge_tools",
                 extra_env={"DEX_RETRY_BACKOFF_MAX_SECONDS": "4.0"})
    with DexClient(slow) as client:
        rt = Runtime(settings=slow, store=client.store,
                     redis=redis.Redis.from_url(slow.redis_url), app=client.app)
        # And a read whose service asked to be retried in 4 s (Celery holds the retry's message)
        record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                  tool="hinted_lookup", arguments={"retry_after": "4"})
        first = started_pid(ledger_path, record.key, attempt=1)
        wait_until(lambda: client.get_tool_call(record.key).status is CallStatus.QUEUED, 10,
                   "the retry to be scheduled")
        queued_at = time.time()

        # When the republisher runs past its window while the retry is still due later
        window = slow.republish_after_seconds
        assert republish_stranded(rt, now=queued_at + window + 0.5) == 0
        # Then it sent nothing: the call ran twice in all, its retry 4 s after its first attempt
        done = client.wait(record.key, timeout=20)
        assert done.status is CallStatus.SUCCEEDED and done.attempts == 2
        runs = [e for e in ledger.read(ledger_path) if e["key"] == record.key]
        assert [e["attempt"] for e in runs] == [1, 2]
        assert runs[0]["pid"] == first
        assert 4.0 * 0.9 <= runs[1]["at"] - runs[0]["at"] < 4.0 + 3.0
        assert rt.redis.llen(queue_for("hinted_lookup")) == 0
        rt.redis.close()
