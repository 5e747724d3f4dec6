"""Issue 28 item 1: an approval rule judges exactly the arguments the tool runs with.

The agent process has no tool code, only the published JSON schema; it normalizes a call's
arguments as the worker's pydantic validation will (lax coercion, defaults filled in), judges
the rule on those, records them and sends them; the worker refuses a call whose arguments its
own validation would change. Calls run on real ``dex-tasks worker`` subprocesses with a real
Redis; the agent is a separate process that imports no tool code.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from typing import Any

import pytest

from dex_tasks import CallStatus, DexClient
from dex_tasks.arguments import InvalidArguments, normalize
from dex_tasks.registry import canonical_json
from dex_tasks.store import catalog
from dex_tasks.store.catalog import ToolInfo
from tests import approval_tools
from tests.conftest import StartWorker
from tests.helpers import agent_calls, wait_until
from workers import ledger

TOOLS = "workers.example_tools,tests.approval_tools"

def _ran(ledger_path: Any, tool: str) -> list[str]:
    return [e["key"] for e in ledger.read(ledger_path) if e["tool"] == tool]


def test_a_string_true_and_a_left_out_default_wait_for_the_rule(
    start_worker: StartWorker, env: dict[str, str], client: DexClient, ledger_path: Any,
) -> None:
    # Given workers that published deploy (rule force == true) and default_refund (rule
    # amount_cents > 10000, amount_cents defaulting to 50000)
    start_worker(tools=TOOLS)
    # When an agent process that imports no tool code sends "true" for force, leaves the
    # amount out, and sends two calls the rules let through
    forced, defaulted, plain, small = agent_calls(env, "s-norm", [
        ("deploy", {"service": "api", "force": "true"}),
        ("default_refund", {"charge_id": "ch_1"}),
        ("deploy", {"service": "web", "force": "off"}),
        ("default_refund", {"charge_id": "ch_2", "amount_cents": "500"}),
    ])
    # Then both calls the rules cover wait for a person, judged on what the tool would run with
    assert forced["status"] == "awaiting_approval"
    assert forced["arguments"] == {"service": "api", "force": True}
    assert forced["approval_rule"]["reason"] == "force=true == true"
    assert defaulted["status"] == "awaiting_approval"
    assert defaulted["arguments"] == {"charge_id": "ch_1", "amount_cents": 50_000}
    assert defaulted["approval_rule"]["reason"] == "amount_cents=50000 > 10000"
    # And the others run, with the values the record shows
    assert client.wait(plain["key"], 30).result == {"service": "web", "force": False}
    assert client.wait(small["key"], 30).result == {"charge_id": "ch_2", "amount_cents": 500}
    assert _ran(ledger_path, "deploy") == [plain["key"]]
    # And repeating the model's request (as sent) returns the same records
    again = client.call_tool(session_id="s-norm", turn_id="t1", tool_call_id="c0",
                             tool="deploy", arguments={"service": "api", "force": "true"})
    assert again.key == forced["key"] and again.status is CallStatus.AWAITING_APPROVAL

    # When a person approves with an edit spelled loosely, the edit is normalized the same way
    assert client.resolve_interrupt("s-norm", defaulted["interrupt_id"], True,
                                    approver="alice", arguments={"charge_id": "ch_1",
                                                                 "amount_cents": "9000"})
    record = client.wait(defaulted["key"], 30)
    assert record.arguments == {"charge_id": "ch_1", "amount_cents": 9_000}
    assert record.result == {"charge_id": "ch_1", "amount_cents": 9_000}
    assert record.arguments_edit == ("the arguments were edited before approval: "
                                     "amount_cents 50000 -> 9000")


def test_wrong_typed_arguments_are_refused_at_call_tool_for_every_effect(
    start_worker: StartWorker, env: dict[str, str], client: DexClient, ledger_path: Any,
) -> None:
    # Issue 31 item 4: a read's wrong-typed argument was queued and failed by the worker,
    # a write's refused at once.
    start_worker(tools=TOOLS)
    read, write = agent_calls(env, "s-typed", [
        ("lookup_order", {"order_id": 1001}),
        ("default_refund", {"charge_id": "ch_1", "amount_cents": "lots"}),
    ])
    for record, field, value in ((read, "order_id", "1001"), (write, "amount_cents", '"lots"')):
        assert record["status"] == "failed", record
        assert "did not run" in record["error"] and "invalid arguments" in record["error"]
        assert field in record["error"] and f"(got {value})" in record["error"]
    assert ledger.read(ledger_path) == []


def test_the_worker_refuses_arguments_its_validation_would_change(
    start_worker: StartWorker, env: dict[str, str], client: DexClient, ledger_path: Any,
) -> None:
    # Given a catalog whose schema for deploy says force is a string (a schema the agent read
    # differently from the worker's signature: the two must not diverge silently)
    start_worker(tools=TOOLS)
    entry = catalog.entry_for(approval_tools.deploy, 0.0)
    schema = json.loads(entry["arguments_schema"])
    schema["properties"]["force"] = {"type": "string"}
    client.store.publish_catalog([{**entry, "arguments_schema": json.dumps(schema),
                                   "updated_at": 1e12}])
    # When the agent records "true" (the rule force == true does not hold on a string)
    (record,) = agent_calls(env, "s-diverge", [("deploy", {"service": "api", "force": "true"})])
    assert record["status"] == "queued" and record["arguments"]["force"] == "true"
    # Then the worker, whose validation would run it with force=True, refuses it unrun
    ended = client.wait(record["key"], 30)
    assert ended.status is CallStatus.FAILED
    assert ended.error is not None and "would change force" in ended.error
    assert _ran(ledger_path, "deploy") == []


# -- the property: every call whose executed arguments satisfy its rule waited ------------------

_VALUES: dict[str, list[Any]] = {
    "amount": [5, "5", 20_000, "20000", 20_000.0, 10_000, "10001", 1.5, "abc", True, None],
    "force": [True, False, "true", "false", "yes", "off", 1, 0, "1", "maybe", None, 2],
    "tier": ["new", "old", "NEW", 1, None],
    "ratio": [2, "2.5", 0.5, "1e1", 2.0, "x", True, None, "inf"],
    "note": [None, "hi", 3, ""],
    "tags": [None, [1, "2"], ["x"], [], "1"],
    "extra": [1],
}


def _generated(seed: int, n: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    calls = []
    for _ in range(n):
        fields = [f for f in _VALUES if rng.random() < (0.05 if f == "extra" else 0.5)]
        calls.append({f: rng.choice(_VALUES[f]) for f in fields})
    return calls


def _published(tool: Any) -> ToolInfo:
    """The tool as an agent process without its code sees it: the catalog's JSON only."""
    entry = catalog.entry_for(tool, 0.0)
    from dex_tasks.policy import ToolPolicy
    return ToolInfo(tool.name, ToolPolicy.from_json(json.loads(entry["policy"])), None,
                    json.loads(entry["arguments_schema"]))


def test_the_published_schema_normalizes_as_the_worker_validates() -> None:
    # Over generated arguments: the agent (the published schema only) and the worker (the
    # signature's pydantic validation) accept and refuse the same calls, agree on the values,
    # and the worker runs a recorded call with exactly what was judged.
    tool = approval_tools.probe
    info = _published(tool)
    rule = approval_tools.PROBE_RULE
    accepted = held = 0
    for arguments in _generated(seed=28, n=3000):
        try:
            agent: dict[str, Any] | None = info.normalize(arguments)
        except InvalidArguments:
            agent = None
        try:
            worker: dict[str, Any] | None = tool.normalize(arguments)
        except InvalidArguments:
            worker = None
        assert (agent is None) == (worker is None), arguments
        if agent is None or worker is None:
            continue
        accepted += 1
        assert canonical_json(agent) == canonical_json(worker), arguments
        executed = tool.recorded_arguments(agent)  # the worker's check passes
        decision = info.policy.approval_for(agent) if info.policy else None
        assert decision is not None
        if rule.evaluate(executed)[0]:
            assert decision.required, arguments
            held += 1
    assert accepted > 500 and held > 200  # the generator reaches both sides


def test_every_call_whose_executed_arguments_satisfy_the_rule_waited(
    start_worker: StartWorker, env: dict[str, str], client: DexClient, ledger_path: Any,
) -> None:
    # Given workers and an agent process with no tool code, making generated probe calls
    start_worker(tools=TOOLS, concurrency=4)
    generated = _generated(seed=31, n=40)
    records = agent_calls(env, "s-prop", [("probe", a) for a in generated])
    # When every call that waits is approved as it stands
    for record in records:
        if record["status"] == "awaiting_approval":
            assert client.resolve_interrupt("s-prop", record["interrupt_id"], True,
                                            approver="alice")
    ended = {r["key"]: client.wait(r["key"], 60) for r in records}
    # Then every call that ran with arguments satisfying the rule had waited for a person
    ran = held = 0
    for record in records:
        done = ended[record["key"]]
        if done.status is not CallStatus.SUCCEEDED:
            assert done.error is not None and "did not run" in done.error, done
            continue
        ran += 1
        assert done.result == done.arguments  # it ran with exactly what was recorded
        if approval_tools.PROBE_RULE.evaluate(done.result)[0]:
            assert done.requires_approval and record["status"] == "awaiting_approval", done
            held += 1
    assert ran >= 5 and held >= 1  # the seed reaches both sides
    wait_until(lambda: len(_ran(ledger_path, "probe")) == ran, 30)


@pytest.mark.timeout(60)
def test_a_catastrophic_pattern_in_a_third_party_schema_does_not_hang() -> None:
    # A third-party (MCP) tool's schema with a pattern that backtracks exponentially in
    # Python's re on this input (about 2**40 steps): checked in linear time instead.
    schema = {"type": "object", "properties": {"code": {"type": "string",
                                                        "pattern": "^(a+)+$"}}}
    bad = {"code": "a" * 40 + "!"}
    with pytest.raises(InvalidArguments, match="code"):
        normalize("mcp_tool", schema, bad)
    from dex_tasks.registry import schema_validator, validate_against_schema
    with pytest.raises(InvalidArguments, match="code"):
        validate_against_schema("mcp_tool", schema_validator(schema), bad)
    keyed = {"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}},
             "additionalProperties": False}
    with pytest.raises(InvalidArguments, match="unexpected"):
        validate_against_schema("mcp_tool", schema_validator(keyed), {"a" * 40 + "!": 1})
    assert normalize("mcp_tool", schema, {"code": "aaa"}) == {"code": "aaa"}
    # A pattern that needs backtracking (a backreference) is not evaluated here at all
    backref = {"type": "object", "properties": {"w": {"type": "string", "pattern": r"(a+)\1"}}}
    assert normalize("mcp_tool", backref, {"w": "a" * 40 + "!"}) == {"w": "a" * 40 + "!"}
    validate_against_schema("mcp_tool", schema_validator(backref), {"w": "a" * 40 + "!"})


def test_an_unknown_tool_says_did_you_mean_in_a_short_traceback(
    env: dict[str, str], client: DexClient,
) -> None:
    # Issue 31 item 4: an unknown tool got an 11-line traceback through the catalog's
    # internals, with no hint of the name meant.
    from dex_tasks.examples import tools as example_tools
    catalog.publish(client.store, [example_tools.lookup_order, example_tools.charge_card])
    script = ("from dex_tasks import DexClient\n"
              "with DexClient.from_env() as client:\n"
              "    client.call_tool(session_id='s', turn_id='t', tool_call_id='c',\n"
              "                     tool='lookup_ordr', arguments={})\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[-1].endswith("did you mean 'lookup_order'?"), lines[-1]
    assert lines[-1].startswith("dex_tasks.errors.UnknownToolError: unknown tool 'lookup_ordr'")
    frames = [line for line in lines if line.lstrip().startswith("File ")]
    # The caller's line and call_tool's (with its tracing wrapper), nothing inside: no frame of
    # the catalog or the store.
    inside = [f for f in frames if "dex_tasks" in f and not f.endswith("in call_tool")
              and not ("dex_tasks/tracing.py" in f and f.endswith("in wrapper"))]
    assert len(frames) <= 3 and not inside, out.stderr


def test_the_openai_agents_needs_approval_asks_the_rule_on_normalized_arguments(
    client: DexClient,
) -> None:
    # The SDK's needs_approval callable judged the model's raw JSON: "true" for force did not
    # pause the run (call_tool then held the call, but the run never surfaced it).
    pytest.importorskip("agents")
    import asyncio

    from dex_tasks.integrations.openai_agents import dex_function_tools
    catalog.publish(client.store, [approval_tools.deploy, approval_tools.default_refund])
    tools = {t.name: t for t in dex_function_tools(client, ["deploy", "default_refund"])}

    def asks(name: str, arguments: dict[str, Any]) -> bool:
        needs = tools[name].needs_approval  # type: ignore[attr-defined]
        return bool(asyncio.run(needs(None, arguments, "c1")))

    assert asks("deploy", {"service": "api", "force": "true"}) is True
    assert asks("deploy", {"service": "api", "force": "off"}) is False
    assert asks("default_refund", {"charge_id": "ch_1"}) is True
    assert asks("default_refund", {"charge_id": "ch_1", "amount_cents": "500"}) is False
