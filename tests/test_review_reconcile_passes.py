"""Issue 19, finding 3: ``reconcile_unknown`` passes never overlap, and each is bounded.

The pass's lock lasted one sweep interval while a pass with slow checkers lasted far longer:
beat sent a new pass every interval, and 40 unknown calls took every worker slot. Now the
lock is renewed while its pass runs and a pass asks at most ``RECONCILE_PER_PASS`` checkers,
the next pass going on where it stopped.
"""

from __future__ import annotations

import itertools
import subprocess
import time
from pathlib import Path

from dex_tasks import CallStatus, DexClient
from dex_tasks.worker.sweeps import RECONCILE_PER_PASS
from tests.conftest import StartWorker
from tests.helpers import wait_until
from workers import ledger

UNKNOWN = RECONCILE_PER_PASS + 10  # more than one pass asks


def _checks(ledger_path: Path) -> list[dict[str, float]]:
    return [e for e in ledger.read(ledger_path) if e["tool"] == "check"]


def test_reconcile_passes_with_a_slow_checker_never_overlap_nor_take_every_slot(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    beat: subprocess.Popen[bytes],
) -> None:
    # Given a worker with two slots and more unknown outcomes than one pass asks about,
    # whose checker takes 0.1 s and never knows (beat sends a pass every 0.5 s)
    start_worker(concurrency=2, tools="workers.example_tools,tests.review_tools")
    keys = [client.call_tool(session_id="s", turn_id="t", tool_call_id=f"u{i}",
                             tool="unsure_slow_check", arguments={"n": i}).key
            for i in range(UNKNOWN)]
    for key in keys:
        assert client.wait(key, 20).status is CallStatus.OUTCOME_UNKNOWN

    # When the passes run for a while: every call's checker is asked (the passes go on
    # where the last one stopped)
    def every_call_asked() -> bool:
        asked = {e["key"] for e in _checks(ledger_path)}
        return asked >= {f"check:{k}" for k in keys}
    wait_until(every_call_asked, 60, "every unknown call's checker to be asked")

    # Then an ordinary call still finds a free slot at once
    started = time.monotonic()
    read = client.call_tool(session_id="s2", turn_id="t", tool_call_id="r",
                            tool="lookup_order", arguments={"order_id": "1001"})
    assert client.wait(read.key, 20).status is CallStatus.SUCCEEDED
    waited = time.monotonic() - started
    assert waited < 5, waited

    # And no two checkers ever ran at once: one pass at a time
    spans = sorted((e["started"], e["ended"]) for e in _checks(ledger_path))
    overlaps = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
    assert overlaps == [], f"{len(overlaps)} of {len(spans)} checks overlapped another"
