"""Issue 19, finding 7: a pruned single-attempt call that ran is never run again by a replay.

Prune deleted the call and left its Redis claim (30 days, 152 B each): a replay under the same
ids was a new call, which the claim then turned away ("did not run" although it ran), and which
ran again once the claim was gone (its TTL passed, Redis restarted). Now prune keeps a
tombstone of the key, deletes the claim, and a replay is refused with PrunedCallError.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from redis import Redis

from dex_tasks import CallStatus, ConflictError, DexClient, PrunedCallError
from dex_tasks.ops.cli_store import forget_claims
from dex_tasks.store.prune import prune
from dex_tasks.worker import claims
from tests.conftest import StartWorker
from workers import ledger

CHARGE = {"customer_id": "cu_1", "amount_cents": 700}


def test_a_pruned_charge_replayed_with_the_same_ids_is_refused_and_never_runs_again(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a charge and a read that ran, and the charge's Redis claim
    start_worker()
    charge = client.call_tool(session_id="s", turn_id="t", tool_call_id="charge",
                              tool="charge_card", arguments=CHARGE)
    read = client.call_tool(session_id="s", turn_id="t", tool_call_id="read",
                            tool="lookup_order", arguments={"order_id": "1001"})
    for record in (charge, read):
        assert client.wait(record.key, 20).status is CallStatus.SUCCEEDED
    r = Redis.from_url(client.settings.redis_url)
    assert claims.read_claim(r, charge.key) is not None

    # When both are pruned (as dex-tasks prune does, with its claim clean-up)
    result = prune(client.store, 60, now=time.time() + 3600,
                   on_pruned=forget_claims(client.settings))
    assert (result.calls, result.tombstones) == (2, 1)
    # Then the charge's claim is gone from Redis
    assert claims.read_claim(r, charge.key) is None

    # And a replay of the charge under the same ids is refused, saying why, even after
    # another prune; nothing is stored or run
    prune(client.store, 60, now=time.time() + 7200)
    with pytest.raises(PrunedCallError, match="ran and was pruned") as refused:
        client.call_tool(session_id="s", turn_id="t", tool_call_id="charge",
                         tool="charge_card", arguments=CHARGE)
    assert isinstance(refused.value, ConflictError) and refused.value.key == charge.key
    assert client.store.get_call(charge.key) is None
    # While a read may run again: it is a new call
    again = client.call_tool(session_id="s", turn_id="t", tool_call_id="read",
                             tool="lookup_order", arguments={"order_id": "1001"})
    assert client.wait(again.key, 20).status is CallStatus.SUCCEEDED
    assert ledger.executions(ledger_path) == {charge.key: 1, read.key: 2}
    r.close()
