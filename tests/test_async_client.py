"""AsyncDexClient against real workers: concurrent calls, approvals, timeouts, a live loop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from dex_tasks import AsyncDexClient, CallStatus, DexSettings
from tests.conftest import StartWorker
from tests.helpers import user_messages
from workers import ledger


def test_many_concurrent_calls_and_an_approval_complete(
    settings: DexSettings, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker(concurrency=2)

    async def agent() -> None:
        async with AsyncDexClient(settings) as client:
            # Given 40 reads requested at once from one event loop
            records = await asyncio.gather(*(
                client.call_tool(session_id="s1", turn_id="t1", tool_call_id=f"c{i}",
                                 tool="lookup_order", arguments={"order_id": "1001"})
                for i in range(40)
            ))
            # Then every one completes, once
            finals = await asyncio.gather(*(client.wait(r.key, timeout=60) for r in records))
            assert [f.status for f in finals] == [CallStatus.SUCCEEDED] * 40
            assert all(f.result["order_id"] == "1001" for f in finals)
            counts = ledger.executions(ledger_path)
            assert all(counts[r.key] == 1 for r in records)
            # A repeat of a call returns the same record without running it again
            again = await client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c0",
                                           tool="lookup_order", arguments={"order_id": "1001"})
            assert again.key == records[0].key and again.status is CallStatus.SUCCEEDED

            # Given a refund that waits for approval, and a message sent while it waits
            refund = await client.call_tool(session_id="s1", turn_id="t2", tool_call_id="r1",
                                            tool="refund_payment",
                                            arguments={"charge_id": "ch_1", "amount_cents": 5})
            assert refund.status is CallStatus.AWAITING_APPROVAL
            assert await client.send_user_message("s1", "also refund shipping") is True
            snapshot = await client.get_agent_snapshot("s1")
            assert [p.key for p in snapshot.pending_interrupts] == [refund.key]
            assert [m.status for m in user_messages(snapshot)] == ["queued"]
            # When it is approved (a second decision changes nothing)
            assert refund.interrupt_id is not None
            assert await client.resolve_interrupt("s1", refund.interrupt_id, True, approver="ann")
            assert not await client.resolve_interrupt("s1", refund.interrupt_id, False)
            # Then it runs, and the turn's end delivers the message
            assert (await client.wait(refund.key, timeout=20)).status is CallStatus.SUCCEEDED
            snapshot = await client.get_agent_snapshot("s1")
            assert [m.status for m in user_messages(snapshot)] == ["delivered"]
            events = await client.events("s1")
            assert {e.key for e in events if e.event == "tool_call_finished"} == (
                {r.key for r in records} | {refund.key}
            )
            later = await client.events("s1", after=events[-1].id)
            assert later == []

    asyncio.run(agent())


def test_wait_times_out_and_never_blocks_the_event_loop(
    settings: DexSettings, start_worker: StartWorker
) -> None:
    start_worker(concurrency=2)

    async def agent() -> tuple[float, int, float]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async with AsyncDexClient(settings) as client:
            tick = asyncio.create_task(ticker())
            # Given a read that takes 1.5 s
            record = await client.call_tool(session_id="s1", turn_id="t1", tool_call_id="slow",
                                            tool="lookup_order",
                                            arguments={"order_id": "1001", "sleep": 1.5})
            # When we wait less than that, then TimeoutError, on time
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="still"):
                await client.wait(record.key, timeout=0.3)
            assert time.monotonic() - started < 1.0
            # When we wait long enough, then the record, while the ticker kept ticking
            gaps.clear()
            started = time.monotonic()
            final = await client.wait(record.key, timeout=20)
            waited = time.monotonic() - started
            assert final.status is CallStatus.SUCCEEDED
            stop.set()
            await tick
        return max(gaps), len(gaps), waited

    max_gap, ticks, waited = asyncio.run(agent())
    # A blocking wait would have frozen the loop for the whole call; one that slept between
    # polls without yielding would leave the ticker a fraction of its ticks.
    assert max_gap < 0.5, f"the event loop stalled for {max_gap:.2f}s"
    assert waited > 0.5
    assert ticks > 0.5 * waited / 0.01, f"{ticks} ticks in {waited:.2f}s: the loop was blocked"
