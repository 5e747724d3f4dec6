"""Existing framework tools served by a worker with no rewrite (issue 18, item 5): a LangChain
``@tool``, an OpenAI ``@function_tool`` and a Pydantic AI tool function published from a
``--tools`` module, with their names, schemas and ``Args:`` descriptions, run on a real
worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from agents import RunContextWrapper, function_tool
from pydantic_ai import RunContext

from dex_tasks import CallStatus, DexClient, EffectClass, ToolDefinitionError
from dex_tasks.integrations.framework_tools import from_framework_tool, parse_args_section
from tests.conftest import StartWorker
from workers import ledger


def test_framework_tools_are_published_with_their_schemas_and_run_on_a_worker(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Three frameworks to import: a slow start on a busy machine.
    start_worker(tools="tests.framework_tools_module", wait=False).wait_ready(timeout=120)
    specs = {s.name: s for s in client.list_tools()}
    assert {"lc_lookup", "oa_ship", "pa_refund"} <= set(specs)

    lookup = specs["lc_lookup"]
    # LangChain keeps the Args: section in its description: it becomes the parameters'.
    assert lookup.description == "Look up an order."
    props = lookup.parameters["properties"]
    assert props["order_id"]["description"] == "The order's id, as the shop prints it."
    assert props["verbose"]["description"] == "Say more."
    assert lookup.parameters["required"] == ["order_id"]
    assert lookup.policy.effect is EffectClass.READ
    assert specs["oa_ship"].parameters["properties"]["express"]["description"] == (
        "Next-day delivery.")
    assert specs["oa_ship"].description == "Ship an order."
    refund = specs["pa_refund"]
    assert refund.parameters["properties"]["amount_cents"]["description"] == (
        "How much to refund, in cents.")
    assert refund.policy.effect is EffectClass.NON_IDEMPOTENT_WRITE
    assert not refund.policy.needs_approval

    calls = [("lc_lookup", {"order_id": "A1", "verbose": True}, "order A1 shipped (by courier)"),
             ("oa_ship", {"order_id": "A2"}, {"shipped": "A2", "express": False}),
             ("pa_refund", {"charge_id": "ch_9", "amount_cents": 250},
              {"refunded": 250, "charge": "ch_9"})]
    for i, (tool, arguments, expected) in enumerate(calls):
        record = client.call_tool(session_id="s-fw", turn_id="t1", tool_call_id=f"c{i}",
                                  tool=tool, arguments=arguments)
        done = client.wait(record.key, timeout=30)
        assert done.status is CallStatus.SUCCEEDED, done.error
        assert done.result == expected
    assert [e["tool"] for e in ledger.read(ledger_path)] == ["lc_lookup", "oa_ship", "pa_refund"]
    # The published schema is checked before the function runs.
    bad = client.call_tool(session_id="s-fw", turn_id="t1", tool_call_id="bad",
                           tool="pa_refund", arguments={"charge_id": "ch_9"})
    bad = client.wait(bad.key, timeout=30)
    assert bad.status is CallStatus.FAILED and "amount_cents" in (bad.error or "")
    assert len(ledger.read(ledger_path)) == 3


def needs_ctx(ctx: RunContext[None], x: int) -> int:
    """Uses deps."""
    return x


@function_tool
def sdk_ctx(ctx: RunContextWrapper[None], x: int) -> int:
    """Uses the run context."""
    return x


def test_args_sections_and_tools_a_worker_cannot_serve() -> None:
    doc = """Do it.

    Args:
        a (int): First
            and more.
        b: Second.

    Returns:
        Nothing.
    """
    assert parse_args_section(doc) == {"a": "First and more.", "b": "Second."}
    assert parse_args_section("No sections.") == {}

    with pytest.raises(ToolDefinitionError, match="RunContext"):
        from_framework_tool(needs_ctx)
    with pytest.raises(ToolDefinitionError, match="run context"):
        from_framework_tool(sdk_ctx)
    with pytest.raises(ToolDefinitionError, match="not an effect class"):
        from_framework_tool(lambda x: x, name="fw_bad_policy", policy="sometimes")
    with pytest.raises(ToolDefinitionError, match="not a LangChain tool"):
        from_framework_tool(42)
