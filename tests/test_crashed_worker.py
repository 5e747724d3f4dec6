"""A crashed worker strands nothing for long (issue 11 item 6).

A worker SIGKILLed as a whole leaves the messages it held in kombu's ``unacked`` hash: retries
waiting out their countdown, late-acked calls it was running, and (with prefetch) calls it had
reserved. Only the visibility timeout (an hour) would hand them back. With default settings
every call of a dead worker must be terminal or running again within 60 s; the messages of live
workers and of other Celery apps on the same Redis must be left alone.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from kombu import Connection

from dex_tasks import CallStatus, DexClient, DexSettings, ToolCallRecord
from dex_tasks.broker.routing import held_tags, queue_for
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import restore_orphaned_messages
from tests.conftest import StartWorker, fast_settings
from tests.helpers import started_pid, wait_until
from workers import ledger

TOOLS = "workers.example_tools,chaos.tools"


def _unacked(rt: Runtime) -> int:
    return int(rt.redis.hlen("unacked"))


class TestWithDefaultSettings:
    """Lease 30 s, sweeps every 10 s, republish after 300 s, visibility timeout 3600 s."""

    @pytest.fixture
    def settings(self, redis_url: str, sqlite_url: str) -> DexSettings:
        return DexSettings(redis_url=redis_url, database_url=sqlite_url,
                           secret_key="test-secret-key")  # type: ignore[arg-type]

    def test_every_call_of_a_sigkilled_worker_is_terminal_or_running_again_within_60s(
        self, client: DexClient, start_worker: StartWorker, ledger_path: Path, rt: Runtime,
        beat: subprocess.Popen[bytes], tmp_path: Path,
    ) -> None:
        doomed = start_worker(concurrency=2, tools=TOOLS)

        def call(call_id: str, tool: str, **arguments: object) -> ToolCallRecord:
            return client.call_tool(session_id="s", turn_id="t", tool_call_id=call_id,
                                    tool=tool, arguments=arguments)

        # Given a worker holding two retries that wait out a 25 s countdown...
        retries = [call(f"retry{i}", "slow_retry_read", order_id="1001", retry_after=25)
                   for i in range(2)]
        wait_until(lambda: all(client.get_tool_call(r.key).attempts == 1
                               and client.get_tool_call(r.key).status is CallStatus.QUEUED
                               for r in retries), 30, "both retries to be scheduled")
        wait_until(lambda: doomed.log().count("[slow_retry_read]") >= 6
                   and _unacked(rt) == 2, 30, "the worker to hold both retries' messages")
        # ...both slots inside tools (a charge, and a late-acked read)...
        charge = call("charge", "charge_card", customer_id="cu_1", amount_cents=100, sleep=600)
        read = call("read", "lookup_order", order_id="1001", sleep=600)
        for record in (charge, read):
            assert started_pid(ledger_path, record.key) in doomed.children()
        # ...and more calls than its slots waiting
        waiting = [call(f"quick{i}", "charge_card" if i % 2 else "lookup_order",
                        **({"customer_id": "cu", "amount_cents": i} if i % 2
                           else {"order_id": "1002"}))
                   for i in range(4)]
        assert _unacked(rt) >= 3  # the two retries and the running (late-acked) read
        everything = [*retries, charge, read, *waiting]

        # When the whole worker is SIGKILLed, and another worker is there
        doomed.kill_all()
        killed_at = time.monotonic()
        survivor = start_worker(concurrency=2, tools=TOOLS)
        node = f"dex-{survivor.pid}@"

        # Then within 60 s every call is terminal or running again on the other worker
        def settled() -> bool:
            for record in everything:
                row = client.store.get_call(record.key)
                assert row is not None
                status, worker = CallStatus(row.status), row.worker
                run = rt.runs.get(record.key) if status is CallStatus.QUEUED else None
                if run is not None:  # a retrying call runs leased in Redis (DESIGN v4)
                    status, worker = CallStatus.RUNNING, run.worker
                if not (status.terminal or (status is CallStatus.RUNNING
                                            and (worker or "").startswith(node))):
                    return False
            return True

        wait_until(settled, 60, "every call of the dead worker to be terminal or running again")
        took = time.monotonic() - killed_at
        print(f"\nevery call settled {took:.1f}s after the kill")
        # The single-attempt charge ended outcome_unknown; nothing single-attempt ran twice
        assert client.get_tool_call(charge.key).status is CallStatus.OUTCOME_UNKNOWN
        runs = ledger.executions(ledger_path)
        assert runs[charge.key] == 1
        assert all(runs[r.key] == 1 for r in waiting if r.tool == "charge_card")
        # The retries' messages were handed back by beat long before the visibility timeout
        for record in retries:
            final = client.wait(record.key, 30)
            assert final.status is CallStatus.SUCCEEDED and final.attempts == 2
        assert (tmp_path / "beat.log").read_text().count("action=message_restored") >= 2
        assert client.get_tool_call(read.key).status is CallStatus.RUNNING


class TestWithALongBackoffCap:
    """A retry that waits out a 12 s countdown: the backoff cap must allow it (issue 11 item 9
    cuts a tool's retry_after to the cap, 0.2 s in the fast test settings)."""

    @pytest.fixture
    def settings(self, redis_url: str, sqlite_url: str) -> DexSettings:
        return fast_settings(redis_url, sqlite_url, retry_backoff_max_seconds=60.0)

    def test_messages_of_live_workers_and_of_other_apps_are_never_restored(
        self, client: DexClient, start_worker: StartWorker, rt: Runtime, redis_url: str,
        ledger_path: Path,
    ) -> None:
        # Given a live worker holding a retry that waits out a 12 s countdown (long enough to
        # be still held when the sweep below runs; asserted there)
        worker = start_worker(concurrency=1, tools=TOOLS, serve="slow_retry_read")
        held = client.call_tool(session_id="s", turn_id="t", tool_call_id="held",
                                tool="slow_retry_read",
                                arguments={"order_id": "1", "retry_after": 12})
        wait_until(lambda: client.get_tool_call(held.key).attempts == 1
                   and client.get_tool_call(held.key).status is CallStatus.QUEUED, 30,
                   "the retry to be scheduled")
        # (received, and listed in the worker's next announcement)
        wait_until(lambda: worker.log().count("[slow_retry_read]") >= 3
                   and held_tags(rt.redis) == {t.decode() for t in rt.redis.hkeys("unacked")}
                   and len(held_tags(rt.redis)) == 1, 30, "the worker to announce the retry")
        [held_tag] = held_tags(rt.redis)
        with Connection(redis_url) as conn:
            # ...a message of another app, received and not acked by a consumer of its own...
            other = conn.SimpleQueue("other.app.queue")
            other.put({"task": "not ours"})
            foreign = other.get(timeout=5)
            # ...and a call whose message a consumer took and then stopped serving (a dead worker)
            lost = client.call_tool(session_id="s", turn_id="t", tool_call_id="lost",
                                    tool="stall_first_attempt",
                                    arguments={"order_id": "1", "sleep": 0})
            dead = conn.SimpleQueue(queue_for("stall_first_attempt"))
            dead.get(timeout=5)
            assert rt.redis.llen(queue_for("stall_first_attempt")) == 0

            # When the sweep runs long after all of them were received
            restored = restore_orphaned_messages(rt, now=time.time() + 120)

            # Then only the dead consumer's message went back to its queue, and it runs
            assert restored == 1
            # (the live worker's retry was still waiting out its countdown when the sweep ran)
            assert rt.redis.hexists("unacked", held_tag)
            assert client.get_tool_call(held.key).attempts == 1
            assert rt.redis.llen(queue_for("stall_first_attempt")) == 1
            start_worker(concurrency=1, tools=TOOLS, serve="stall_first_attempt")
            assert client.wait(lost.key, 30).status is CallStatus.SUCCEEDED
            assert rt.redis.hexists("unacked", foreign.delivery_tag)
            foreign.ack()
            # And the live worker's retry is still its own: it runs once, at its time
            final = client.wait(held.key, 60)
            assert final.status is CallStatus.SUCCEEDED and final.attempts == 2
            assert ledger.executions(ledger_path)[held.key] == 2
        worker.kill_all()
