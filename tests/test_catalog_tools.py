"""What framework adapters need from the core: ``list_tools()`` from the published catalog,
tools defined at run time from a name, a JSON schema and a function, and
``OutcomeUnknownError`` (issue 10, item 1), against a real worker.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from dex_tasks import (
    OUTCOME_UNKNOWN_TOOL_RESULT,
    TOOL_DID_NOT_RUN,
    AsyncDexClient,
    CallStatus,
    DexClient,
    EffectClass,
    ToolDefinitionError,
    define_tool,
)
from tests.conftest import StartWorker
from workers import example_tools, ledger

# The example tools are imported here (charge_card's explicit policy is read locally); the
# run-time tools of tests.runtime_tools are not, so those come from the published catalog.
assert example_tools.charge_card.name == "charge_card"

TOOLS = "workers.example_tools,tests.runtime_tools"


@pytest.fixture
def worker(start_worker: StartWorker) -> None:
    start_worker(concurrency=2, tools=TOOLS)


def test_list_tools_describes_the_published_catalog(client: DexClient, worker: None) -> None:
    # This process never imported the run-time tools: what we read comes from the catalog.
    assert "tests.runtime_tools" not in sys.modules
    specs = {spec.name: spec for spec in client.list_tools()}

    price = specs["price_sku"]
    assert price.description == "Price a quantity of one SKU."
    assert price.parameters["required"] == ["sku", "qty"]
    assert price.parameters["properties"]["class"]["enum"] == ["retail", "wholesale"]
    assert price.policy.effect is EffectClass.READ and not price.policy.needs_approval

    # No policy, only MCP annotations: they decide, and the hints travel with the tool.
    delete = specs["delete_listing"]
    assert delete.policy.effect is EffectClass.NON_IDEMPOTENT_WRITE
    assert delete.policy.needs_approval
    assert delete.hints == {"destructiveHint": True, "readOnlyHint": False}

    # Signature-made tools: the docstring is the description, the signature the schema.
    lookup = specs["lookup_order"]
    assert lookup.description == "Look up an order by id."
    assert lookup.parameters["required"] == ["order_id"]
    assert specs["charge_card"].policy.effect is EffectClass.NON_IDEMPOTENT_WRITE
    assert not specs["charge_card"].policy.needs_approval


def test_async_client_lists_the_same_tools(client: DexClient, worker: None) -> None:
    async def names_of_tools() -> list[str]:
        return [spec.name for spec in await AsyncDexClient(client=client).list_tools()]

    names = asyncio.run(names_of_tools())
    assert names == [spec.name for spec in client.list_tools()]
    assert names == sorted(names) and "price_sku" in names


def test_a_run_time_tool_runs_with_schema_checked_arguments(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    good = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1", tool="price_sku",
                            arguments={"sku": "ab1", "qty": 2, "class": "wholesale"})
    done = client.wait(good.key, 20)
    assert done.status is CallStatus.SUCCEEDED
    assert done.result == {"sku": "ab1", "total_cents": 500}

    # The worker checks the arguments against the published schema, naming each bad field.
    bad = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c2", tool="price_sku",
                           arguments={"sku": "a", "qty": 0})
    failed = client.wait(bad.key, 20)
    assert failed.status is CallStatus.FAILED
    assert (failed.error or "").startswith(TOOL_DID_NOT_RUN)
    assert "sku:" in (failed.error or "") and "qty:" in (failed.error or "")
    assert ledger.executions(ledger_path) == {good.key: 1}


def test_arguments_the_tool_refuses_are_never_sent_to_a_person(
    client: DexClient, worker: None
) -> None:
    # Given an agent process without the tool code, and a tool that needs approval
    assert "tests.runtime_tools" not in sys.modules
    # When the model sends arguments the published schema refuses
    bad = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                           tool="delete_listing", arguments={"listing": "L-1"})
    # Then the call ends "did not run" at once, and nobody is asked to approve it
    assert bad.status is CallStatus.FAILED
    assert (bad.error or "").startswith(TOOL_DID_NOT_RUN)
    assert "listing_id" in (bad.error or "")
    snapshot = client.get_agent_snapshot("s1")
    assert snapshot.pending_interrupts == []
    # While good arguments wait for a person as the policy says
    good = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c2",
                            tool="delete_listing", arguments={"listing_id": "L-1"})
    assert good.status is CallStatus.AWAITING_APPROVAL


@pytest.mark.parametrize("tool", ["unsure_read", "unsure_charge"])
def test_outcome_unknown_error_ends_the_call_and_it_never_runs_again(
    client: DexClient, worker: None, ledger_path: Path, tool: str
) -> None:
    arguments = {"query": "shoes"} if tool == "unsure_read" else {"amount_cents": 500}
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1", tool=tool,
                              arguments=arguments)
    done = client.wait(record.key, 20)
    # A read with attempts left included: the tool said it cannot tell, so no retry.
    assert done.status is CallStatus.OUTCOME_UNKNOWN
    assert done.attempts == 1
    assert (done.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert "timed out" in (done.error or "") or "connection dropped" in (done.error or "")
    assert ledger.executions(ledger_path) == {record.key: 1}


def test_list_tools_applies_the_session_default_to_unclassified_tools(
    client: DexClient,
) -> None:
    define_tool("mystery_tool", {"type": "object", "properties": {}},
                lambda ctx, arguments: None)
    specs = {s.name: s for s in client.list_tools()}
    assert specs["mystery_tool"].policy.effect is EffectClass.UNCLASSIFIED
    defaulted = {s.name: s for s in client.list_tools(default_effect="read")}
    assert defaulted["mystery_tool"].policy.effect is EffectClass.READ
    # An explicit policy still wins over the session default.
    assert defaulted["charge_card"].policy.effect is EffectClass.NON_IDEMPOTENT_WRITE


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"type": "object", "properties": {"n": {"type": "nonsense"}}}, "not a valid JSON schema"),
        ({"type": "array"}, "must describe an object"),
    ],
)
def test_a_bad_run_time_schema_is_refused_naming_the_tool(
    parameters: dict[str, object], says: str
) -> None:
    with pytest.raises(ToolDefinitionError, match="bad_schema_tool") as caught:
        define_tool("bad_schema_tool", parameters, lambda ctx, arguments: None)
    assert says in str(caught.value)
