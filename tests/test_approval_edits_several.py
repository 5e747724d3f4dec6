"""Editing a call that needs several approvers (issue 21, item 3), on SQLite and PostgreSQL, with
a real worker serving ``wire_transfer`` (two approvals holding ``payments.approve``).

The rule (docs/approvals.md): an approval whose arguments differ from the call's current ones
is an edit; the edited version needs its own approvals, the editor's the first, and the ones
the previous version had stay in the audit but no longer count. No approval ever counts for a
version its approver did not approve, however the deciders race.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from dex_tasks import CallStatus, DexClient, DexSettings, MessageRole, StaleApprovalError
from dex_tasks.api import create_api
from dex_tasks.ops.cli import app as cli_app
from dex_tasks.store import APPROVALS
from dex_tasks.tokens import issue_token
from tests.conftest import StartWorker, fast_settings, settings_env
from tests.helpers import wait_until
from workers import ledger

PERM = ["payments.approve"]
ASKED = {"account": "DE89", "amount_cents": 100_000}
EDITED = {"account": "DE89", "amount_cents": 50_000}


@pytest.fixture
def db_settings(redis_url: str, database_url: str) -> DexSettings:
    return fast_settings(redis_url, database_url)


@pytest.fixture
def db_client(db_settings: DexSettings) -> Iterator[DexClient]:
    with DexClient(db_settings) as c:
        yield c


@pytest.fixture
def worker(start_worker: StartWorker, redis_url: str, database_url: str,
           ledger_path: Path) -> None:
    env = settings_env(fast_settings(redis_url, database_url), ledger_path)
    start_worker(tools="workers.example_tools", extra_env=env)


def _wire(client: DexClient, session: str, call_id: str) -> Any:
    record = client.call_tool(session_id=session, turn_id="t1", tool_call_id=call_id,
                              tool="wire_transfer", arguments=ASKED)
    assert record.status is CallStatus.AWAITING_APPROVAL and record.interrupt_id
    return record


def _approve(client: DexClient, session: str, interrupt: str, who: str,
             arguments: dict[str, Any] | None = None) -> bool:
    return client.resolve_interrupt(session, interrupt, True, approver=who, permissions=PERM,
                                    arguments=arguments)


def test_an_edit_restarts_the_approvals_on_the_edited_version(
    db_client: DexClient, worker: None, ledger_path: Path, db_settings: DexSettings
) -> None:
    db_env = settings_env(db_settings, ledger_path)
    call = _wire(db_client, "s-ed", "c1")
    interrupt = call.interrupt_id
    # Given alice approved the model's arguments
    assert _approve(db_client, "s-ed", interrupt, "alice")
    # When bob approves with other arguments, on the command line
    cli = CliRunner().invoke(cli_app, [
        "approvals", "approve", "s-ed", interrupt, "--approver", "bob",
        "--permission", "payments.approve", "--arguments", json.dumps(EDITED)], env=db_env)
    assert cli.exit_code == 0, cli.output
    assert "approval counted: 1 of 2" in cli.stdout
    assert "amount_cents 100000 -> 50000; the approvals start again" in cli.stdout
    # Then the call still waits, on the edited version, with bob's approval its first
    (pending,) = db_client.get_agent_snapshot("s-ed").pending_interrupts
    assert (pending.arguments, pending.original_arguments) == (EDITED, ASKED)
    assert pending.approved_by == ["bob"]
    # And the audit names the editor and the approval that no longer counts
    (edit,) = [e for e in db_client.events("s-ed") if e.event == "tool_call_arguments_edited"]
    assert edit.detail is not None
    assert (edit.detail["approver"], edit.detail["superseded"]) == ("bob", ["alice"])
    assert edit.detail["edit"].endswith("amount_cents 100000 -> 50000")
    # Bob again changes nothing (naming the version he approved)
    assert not db_client.resolve_interrupt("s-ed", interrupt, True, approver="bob",
                                           permissions=PERM,
                                           arguments_version=pending.arguments_version)
    # A plain approval no longer says which version it approves: refused (issue 28 item 3)
    with pytest.raises(StaleApprovalError, match="the arguments changed"):
        _approve(db_client, "s-ed", interrupt, "alice")
    # Alice approving exactly the edited version decides
    assert _approve(db_client, "s-ed", interrupt, "alice", EDITED)
    record = db_client.wait(call.key, 20)
    # The tool ran once with the edited arguments; the record and the decision keep both
    assert record.status is CallStatus.SUCCEEDED
    assert record.result == {"account": "DE89", "sent_cents": 50_000}
    assert record.original_arguments == ASKED
    (decided,) = db_client.get_agent_snapshot("s-ed").decided
    assert decided.approved_by == ["bob", "alice"] and decided.original_arguments == ASKED
    queued = [e for e in db_client.events("s-ed") if e.event == "tool_call_queued"]
    assert queued[0].detail is not None and queued[0].detail["original_arguments"] == ASKED
    # And the transcript's tool message tells the model
    (message,) = [m for m in db_client.get_agent_snapshot("s-ed").messages
                  if m.role is MessageRole.TOOL]
    note = "the arguments were edited before approval: amount_cents 100000 -> 50000"
    assert message.text == note
    # ... and so does the HTTP snapshot (the page's transcript)
    token = issue_token("test-secret-key", "s-ed", approver="alice")
    with TestClient(create_api(db_settings)) as http:
        served = http.get("/sessions/s-ed/snapshot",
                          headers={"Authorization": f"Bearer {token}"}).json()
    assert [m["text"] for m in served["messages"] if m["role"] == "tool"] == [note]
    # Editing back to the model's arguments is an edit too, and leaves no note
    back = _wire(db_client, "s-ed", "c2")
    assert _approve(db_client, "s-ed", back.interrupt_id, "alice", EDITED)
    assert _approve(db_client, "s-ed", back.interrupt_id, "bob", ASKED)
    assert _approve(db_client, "s-ed", back.interrupt_id, "carol")  # the model's, unedited
    again = db_client.wait(back.key, 20)
    assert (again.arguments, again.original_arguments, again.arguments_edit) == (
        ASKED, None, None)
    assert ledger.executions(ledger_path) == {call.key: 1, back.key: 1}


def test_racing_approvers_and_editors_never_count_an_approval_for_another_version(
    db_client: DexClient, worker: None, ledger_path: Path
) -> None:
    # Each decider passes the arguments it approves: the model's, or an edit.
    deciders = {"ann": ASKED, "ben": EDITED, "cat": ASKED, "dan": EDITED}
    calls = [_wire(db_client, "s-race", f"c{i}") for i in range(4)]
    for call in calls:
        # When four people decide the same call at the same moment
        go = threading.Barrier(len(deciders))

        def decide(who: str, interrupt: str = call.interrupt_id,
                   go: threading.Barrier = go) -> None:
            go.wait()
            _approve(db_client, "s-race", interrupt, who, deciders[who])

        threads = [threading.Thread(target=decide, args=(who,)) for who in deciders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for call in calls:
        record = db_client.get_tool_call(call.key)
        with db_client.store.read() as conn:
            counted = list(conn.execute(select(APPROVALS.c.approver).where(
                APPROVALS.c.interrupt_id == call.interrupt_id)).scalars())
        decided = [d for d in db_client.get_agent_snapshot("s-race").decided
                   if d.key == call.key]
        approvers = decided[0].approved_by if decided else counted
        # Then every approval that counts was given for the version the call has now
        assert approvers and all(deciders[who] == record.arguments for who in approvers)
        if decided:
            # And a decided call had two approvals of that version and runs with it, once
            assert len(approvers) == 2
            ended = db_client.wait(call.key, 20)
            assert ended.result == {"account": "DE89",
                                    "sent_cents": record.arguments["amount_cents"]}
        else:
            assert record.status is CallStatus.AWAITING_APPROVAL and len(approvers) == 1
    # Nothing ran twice, and only the calls decided ran
    wait_until(lambda: all(db_client.get_tool_call(c.key).status is not CallStatus.RUNNING
                           for c in calls), 20)
    succeeded = {c.key for c in calls
                 if db_client.get_tool_call(c.key).status is CallStatus.SUCCEEDED}
    assert ledger.executions(ledger_path) == {key: 1 for key in succeeded}
