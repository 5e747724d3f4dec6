"""Approvals that reach people, items 1-3: rules on the arguments, edit on approval, several
approvers. Calls run on real ``dex-tasks worker`` subprocesses with a real Redis, on SQLite and
PostgreSQL; the agent that decides a rule is a separate process that imports no tool code.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from dex_tasks import (
    ApproverPermissionError,
    CallStatus,
    DexClient,
    InvalidArgumentError,
    InvalidEditError,
    InvalidPolicyError,
    RuleError,
    ToolPolicy,
    when,
)
from dex_tasks.api import create_api
from dex_tasks.ops.cli import app as cli_app
from dex_tasks.rules import ApprovalRule, all_of, any_of, not_
from dex_tasks.store import APPROVALS, INTERRUPTS
from dex_tasks.tokens import issue_token
from tests.conftest import StartWorker, fast_settings, settings_env
from tests.helpers import agent_calls, wait_until
from workers import ledger

TOOLS = "workers.example_tools,tests.approval_tools"

# -- the rule language (pure) ---------------------------------------------------------------------


def test_rules_decide_from_the_arguments_and_say_why() -> None:
    rule = when("amount_cents", ">", 10_000)
    assert rule.evaluate({"amount_cents": 20_000}) == (True, "amount_cents=20000 > 10000")
    assert rule.evaluate({"amount_cents": 500})[0] is False
    assert rule.evaluate({})[0] is False  # a missing field is not a match
    nested = all_of(when("customer.tier", "in", ["new", "trial"]), not_(when("note", "exists")))
    assert nested.evaluate({"customer": {"tier": "new"}})[0] is True
    assert nested.evaluate({"customer": {"tier": "new"}, "note": "x"})[0] is False
    assert any_of(when("a", "==", 1), when("b", "contains", "x")).evaluate({"b": "xyz"})[0]
    # The JSON form is the same rule, and round-trips through the catalog's policy JSON
    policy = ToolPolicy(effect="non_idempotent_write",
                        requires_approval={"field": "amount_cents", "op": ">", "value": 10_000},
                        approvals=2, approver_permission="payments.approve",
                        webhooks=("https://hooks.example.com/dex",))
    assert policy.requires_approval == rule
    assert ToolPolicy.from_json(json.loads(json.dumps(policy.to_json()))) == policy


@pytest.mark.parametrize(("spec", "named"), [
    ({"field": "", "op": ">", "value": 1}, "rule.field"),
    ({"field": "a", "op": "~", "value": 1}, "rule.op"),
    ({"field": "a", "op": "in", "value": 3}, "rule.value"),
    ({"all": []}, "rule.all"),
    ({"any": [{"field": "a", "op": ">"}]}, "rule.any[0]"),
    ("amount > 5", "rule must be a JSON object"),
])
def test_a_malformed_rule_is_refused_naming_where(spec: Any, named: str) -> None:
    with pytest.raises(RuleError, match=named.replace("[", r"\[").replace("]", r"\]")):
        ApprovalRule.of(spec)
    with pytest.raises(InvalidPolicyError, match="requires_approval"):
        ToolPolicy(effect="read", requires_approval=spec)


def test_a_rule_that_cannot_be_evaluated_fails_closed() -> None:
    policy = ToolPolicy(effect="read", requires_approval=when("note", ">", 5))
    decision = policy.approval_for({"note": "abc"})
    assert decision.required is True
    assert decision.error is not None and "cannot compare note" in decision.error
    assert ToolPolicy(effect="read", approvals=1).approval_for({}).required is False
    with pytest.raises(InvalidPolicyError, match="approvals"):
        ToolPolicy(effect="read", approvals=0)
    with pytest.raises(InvalidPolicyError, match="approver_permission"):
        ToolPolicy(effect="read", approver_permission="no spaces")


# -- on real workers -------------------------------------------------------------------------------

@pytest.fixture
def db_env(redis_url: str, database_url: str, ledger_path: Any) -> dict[str, str]:
    return settings_env(fast_settings(redis_url, database_url), ledger_path)


@pytest.fixture
def db_client(redis_url: str, database_url: str) -> Iterator[DexClient]:
    with DexClient(fast_settings(redis_url, database_url)) as c:
        yield c


def _workers(start_worker: StartWorker, env: dict[str, str]) -> None:
    start_worker(tools=TOOLS, extra_env=env)


def test_rules_hold_only_matching_calls_and_edits_run_the_edited_arguments(
    start_worker: StartWorker, db_env: dict[str, str], db_client: DexClient, ledger_path: Any,
    redis_url: str, database_url: str,
) -> None:
    # Given workers that published issue_refund (rule: amount_cents > 10000) and annotate
    _workers(start_worker, db_env)
    # When an agent process that imports no tool code makes these calls
    small, large, odd, by_http, by_cli = agent_calls(db_env, "s-rule", [
        ("issue_refund", {"charge_id": "ch_1", "amount_cents": 500}),
        ("issue_refund", {"charge_id": "ch_9", "amount_cents": 50_000}),
        ("annotate", {"note": "abc"}),
        ("issue_refund", {"charge_id": "ch_h", "amount_cents": 30_000}),
        ("issue_refund", {"charge_id": "ch_c", "amount_cents": 30_000}),
    ])
    # Then the small refund runs without a person; the snapshot keeps the rule and its reason
    assert small["requires_approval"] is False
    assert small["approval_rule"] == {
        "rule": {"field": "amount_cents", "op": ">", "value": 10_000}, "required": False,
        "reason": "not amount_cents=500 > 10000", "error": None}
    assert db_client.wait(small["key"], 20).status is CallStatus.SUCCEEDED
    # And the large one waits, saying which comparison held it
    assert large["status"] == "awaiting_approval" and large["requires_approval"] is True
    assert large["approval_rule"]["reason"] == "amount_cents=50000 > 10000"
    # And a rule that cannot be evaluated makes its call wait too (fail closed), saying why
    assert odd["status"] == "awaiting_approval"
    assert odd["approval_rule"]["required"] is True
    assert "cannot compare note" in odd["approval_rule"]["error"]
    pending = {p.key for p in db_client.get_agent_snapshot("s-rule").pending_interrupts}
    assert pending == {large["key"], odd["key"], by_http["key"], by_cli["key"]}

    # -- edit on approval, in Python --
    interrupt = large["interrupt_id"]
    # A wrong edit is refused naming the field, and changes nothing
    with pytest.raises(InvalidEditError, match="amount_cents"):
        db_client.resolve_interrupt("s-rule", interrupt, True, approver="alice",
                                    arguments={"charge_id": "ch_9", "amount_cents": "lots"})
    with pytest.raises(InvalidEditError, match="only be given when approving"):
        db_client.resolve_interrupt("s-rule", interrupt, False, arguments={"x": 1})
    assert db_client.get_tool_call(large["key"]).status is CallStatus.AWAITING_APPROVAL
    # When a person approves with a smaller amount
    assert db_client.resolve_interrupt("s-rule", interrupt, True, approver="alice",
                                       arguments={"charge_id": "ch_9", "amount_cents": 9_000})
    record = db_client.wait(large["key"], 20)
    # Then the tool ran once, with the edited arguments, under the same key
    assert record.status is CallStatus.SUCCEEDED
    assert record.result == {"charge_id": "ch_9", "refunded_cents": 9_000}
    # And the record keeps both versions; the model's text says what changed
    assert record.arguments == {"charge_id": "ch_9", "amount_cents": 9_000}
    assert record.original_arguments == {"charge_id": "ch_9", "amount_cents": 50_000}
    assert record.arguments_edit == ("the arguments were edited before approval: "
                                     "amount_cents 50000 -> 9000")
    # And so does the audit: the approval's event and the decision
    queued = [e for e in db_client.events("s-rule")
              if e.event == "tool_call_queued" and e.key == large["key"]]
    assert queued[0].detail is not None
    assert queued[0].detail["original_arguments"]["amount_cents"] == 50_000
    assert queued[0].detail["arguments"]["amount_cents"] == 9_000
    decided = db_client.get_agent_snapshot("s-rule").decided[0]
    assert decided.original_arguments == {"charge_id": "ch_9", "amount_cents": 50_000}
    # And the agent repeating its request (the model's arguments) gets the same record
    again = db_client.call_tool(session_id="s-rule", turn_id="t1", tool_call_id="c1",
                                tool="issue_refund",
                                arguments={"charge_id": "ch_9", "amount_cents": 50_000})
    assert again.key == large["key"] and again.status is CallStatus.SUCCEEDED

    # -- over HTTP: the body's "arguments" (400 naming the field when wrong) --
    token = issue_token("test-secret-key", "s-rule", approver="bob")
    with TestClient(create_api(fast_settings(redis_url, database_url))) as http:
        auth = {"Authorization": f"Bearer {token}"}
        bad = http.post("/interrupts/resolve", headers=auth, json={
            "interrupt_id": by_http["interrupt_id"], "approved": True,
            "arguments": {"charge_id": "ch_h", "amount_cents": -1.5}})
        assert bad.status_code == 400 and "amount_cents" in bad.json()["error"]
        assert http.post("/interrupts/resolve", headers=auth, json={
            "interrupt_id": by_http["interrupt_id"], "approved": True,
            "arguments": ["not", "an", "object"]}).status_code == 400
        ok = http.post("/interrupts/resolve", headers=auth, json={
            "interrupt_id": by_http["interrupt_id"], "approved": True,
            "arguments": {"charge_id": "ch_h", "amount_cents": 100}})
        assert ok.json() == {"accepted": True}
    assert db_client.wait(by_http["key"], 20).result == {"charge_id": "ch_h",
                                                        "refunded_cents": 100}
    # -- and from the command line --
    cli = CliRunner().invoke(cli_app, [
        "approvals", "approve", "s-rule", by_cli["interrupt_id"],
        "--arguments", '{"charge_id": "ch_c", "amount_cents": 7}'], env=db_env)
    assert cli.exit_code == 0, cli.output
    assert "amount_cents 30000 -> 7" in cli.stdout
    assert db_client.wait(by_cli["key"], 20).original_arguments == {"charge_id": "ch_c",
                                                                   "amount_cents": 30_000}
    # Each approved call ran exactly once
    assert sorted(e["key"] for e in ledger.read(ledger_path)) == sorted(
        [small["key"], large["key"], by_http["key"], by_cli["key"]])


def _wires(client: DexClient, session: str, n: int) -> list[dict[str, Any]]:
    return [client.call_tool(session_id=session, turn_id="t1", tool_call_id=f"c{i}",
                             tool="wire_transfer",
                             arguments={"account": f"A{i}", "amount_cents": i + 1}
                             ).model_dump(mode="json") for i in range(n)]


def test_several_approvers_with_the_permission_decide_and_races_keep_one_outcome(
    start_worker: StartWorker, db_env: dict[str, str], redis_url: str, database_url: str,
    db_client: DexClient, ledger_path: Any,
) -> None:
    # Given a worker that published wire_transfer (two approvals holding payments.approve)
    _workers(start_worker, db_env)
    wire, other = _wires(db_client, "s-two", 2)
    perm = ["payments.approve"]
    # Without the permission: refused, nothing recorded
    with pytest.raises(ApproverPermissionError, match=r"payments\.approve"):
        db_client.resolve_interrupt("s-two", wire["interrupt_id"], True, approver="mallory")
    with pytest.raises(InvalidArgumentError, match="approver is required"):
        db_client.resolve_interrupt("s-two", wire["interrupt_id"], True, permissions=perm)
    # The first approval counts and the call still waits; the page's data shows who
    assert db_client.resolve_interrupt("s-two", wire["interrupt_id"], True, approver="alice",
                                       permissions=perm)
    (pending,) = [p for p in db_client.get_agent_snapshot("s-two").pending_interrupts
                  if p.key == wire["key"]]
    assert (pending.approved_by, pending.approvals_required) == (["alice"], 2)
    # The same approver again changes nothing
    assert not db_client.resolve_interrupt("s-two", wire["interrupt_id"], True,
                                           approver="alice", permissions=perm)
    assert db_client.get_tool_call(wire["key"]).status is CallStatus.AWAITING_APPROVAL
    # Over HTTP: a token without the named permission gets 403; one with it decides
    settings = fast_settings(redis_url, database_url)
    with TestClient(create_api(settings)) as http:
        plain = issue_token("test-secret-key", "s-two", approver="bob")
        granted = issue_token("test-secret-key", "s-two", approver="bob",
                              permissions=("operate", "payments.approve"))
        body = {"interrupt_id": wire["interrupt_id"], "approved": True}
        refused = http.post("/interrupts/resolve", json=body,
                            headers={"Authorization": f"Bearer {plain}"})
        assert refused.status_code == 403 and "payments.approve" in refused.json()["detail"]
        assert http.post("/interrupts/resolve", json=body, headers={
            "Authorization": f"Bearer {granted}"}).json() == {"accepted": True}
    record = db_client.wait(wire["key"], 20)
    assert record.status is CallStatus.SUCCEEDED
    decided = [d for d in db_client.get_agent_snapshot("s-two").decided if d.key == wire["key"]]
    assert decided[0].approved_by == ["alice", "bob"] and decided[0].decided_by == "bob"
    # The first rejection decides, even after an approval
    assert db_client.resolve_interrupt("s-two", other["interrupt_id"], True, approver="alice",
                                       permissions=perm)
    assert db_client.resolve_interrupt("s-two", other["interrupt_id"], False, approver="carol",
                                       rejection_message="not this account", permissions=perm)
    assert db_client.get_tool_call(other["key"]).status is CallStatus.REJECTED
    assert [e["key"] for e in ledger.read(ledger_path)] == [wire["key"]]

    # -- races: three approvers and one rejecter decide each call at the same moment --
    calls = _wires(db_client, "s-race", 4)
    perm = ["payments.approve"]
    for call in calls:
        # When three approvers and one rejecter decide at the same moment
        go = threading.Barrier(4)
        results: dict[str, bool] = {}

        def decide(who: str, approve: bool, interrupt: str = call["interrupt_id"],
                   go: threading.Barrier = go, results: dict[str, bool] = results) -> None:
            go.wait()
            results[who] = db_client.resolve_interrupt("s-race", interrupt, approve,
                                                       approver=who, permissions=perm)

        threads = [threading.Thread(target=decide, args=(who, who != "rex"))
                   for who in ("ann", "ben", "cat", "rex")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # Then exactly one outcome: approved by exactly two (the rejection lost), or
        # rejected by rex with fewer than two approvals counted before it
        with db_client.store.read() as conn:
            row = conn.execute(select(INTERRUPTS).where(
                INTERRUPTS.c.interrupt_id == call["interrupt_id"])).one()
            votes = list(conn.execute(select(APPROVALS.c.approver).where(
                APPROVALS.c.interrupt_id == call["interrupt_id"])).scalars())
        status = db_client.get_tool_call(call["key"]).status
        if row.decision == "approved":
            assert len(votes) == 2 and row.approvals_given == 2 and not results["rex"]
            assert status in (CallStatus.QUEUED, CallStatus.RUNNING, CallStatus.SUCCEEDED)
            assert sum(results.values()) == 2
        else:
            assert row.decision == "rejected" and row.decided_by == "rex" and results["rex"]
            assert len(votes) < 2 and status is CallStatus.REJECTED
    wait_until(lambda: all(db_client.get_tool_call(c["key"]).terminal for c in calls), 30)


def test_the_langchain_tool_message_says_the_arguments_were_edited() -> None:
    from datetime import UTC, datetime

    from dex_tasks import ToolCallRecord
    from dex_tasks.integrations.langchain import _tool_message

    record = ToolCallRecord(
        key="s/t/c", session_id="s", turn_id="t", tool_call_id="c", tool="issue_refund",
        arguments={"amount_cents": 9_000}, original_arguments={"amount_cents": 50_000},
        effect="non_idempotent_write", requires_approval=True, status="succeeded",
        result={"refunded_cents": 9_000}, created_at=datetime.now(UTC))
    message = _tool_message(record, {"id": "c", "name": "issue_refund", "args": {}})
    assert message.content.startswith(
        "(the arguments were edited before approval: amount_cents 50000 -> 9000)\n")
    assert '"refunded_cents": 9000' in message.content
