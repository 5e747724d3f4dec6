"""``dex-tasks mcp``: the published catalog as an MCP server (issue 22), driven by the ``mcp``
SDK's own client over stdio (a ``dex-tasks mcp`` subprocess) and streamable HTTP (a running
``dex-tasks mcp --http``), against real workers. What each test shows:

* the catalog is listed with each tool's schema and annotations from its dex policy; a read's
  result reaches the client; a failed tool and an unknown tool come back as errors with the
  dex texts; the same ``_meta`` ids, or the same JSON-RPC request sent again on the same
  connection, never run a tool twice;
* over HTTP, the token is checked before anything is read (none, forged, ``view``: 401/403,
  nothing stored); a session token gives its session; an approval is waited for with progress
  notifications up to the timeout, then the result says it awaits approval and where; asked
  again after the decision, the approved call has run once and a rejection reaches the client.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    CallStatus,
    DexClient,
    issue_token,
)
from dex_tasks.integrations.mcp_server import AWAITING_APPROVAL
from tests.conftest import StartWorker
from tests.helpers import ROOT, dex_command, free_port, start_process, wait_until
from workers import ledger

SECRET = "test-secret-key"  # fast_settings' DEX_SECRET_KEY


@pytest.fixture
def worker(start_worker: StartWorker) -> None:
    start_worker(concurrency=2)


def stdio_params(env: dict[str, str], *args: str) -> StdioServerParameters:
    command = dex_command()
    return StdioServerParameters(command=command[0], args=[*command[1:], "mcp", *args],
                                 env=env, cwd=str(ROOT))


def text_of(result: Any) -> str:
    return "".join(getattr(part, "text", "") for part in result.content)


@pytest.fixture
def http_server(env: dict[str, str], tmp_path: Path, start_worker: StartWorker) -> Iterator[str]:
    """A ``dex-tasks mcp --http`` on a free port and a worker, started side by side; yields
    the server's URL once both are ready."""
    port = free_port()
    proc = start_process(["mcp", "--http", "--port", str(port), "--approval-timeout", "1.5",
                          "--page-url", "http://dex.example"], env, tmp_path / "mcp.log")
    start_worker(concurrency=2, wait=False).wait_ready()
    url = f"http://127.0.0.1:{port}/mcp"

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "mcp.log").read_text()
        try:
            return httpx.get(url).status_code == 401
        except httpx.TransportError:
            return False

    wait_until(up, 30, "dex-tasks mcp --http to listen")
    yield url
    proc.kill()
    proc.wait(10)


def test_over_stdio_the_catalog_reads_errors_and_repeats(
    client: DexClient, worker: None, env: dict[str, str], ledger_path: Path
) -> None:
    async def scenario(dex: DexClient) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with Client(stdio_client(stdio_params(env, "--session", "s-stdio",
                                                  "--call-timeout", "1"))) as mcp:
            tools = {tool.name: tool for tool in (await mcp.list_tools()).tools}
            seen["tools"] = tools
            meta = {"dex/turn_id": "t1", "dex/tool_call_id": "c1"}
            seen["read"] = await mcp.call_tool("lookup_order", {"order_id": "1001"}, meta=meta)
            seen["again"] = await mcp.call_tool("lookup_order", {"order_id": "1001"}, meta=meta)
            seen["plain"] = await mcp.call_tool("lookup_order", {"order_id": "1002"})
            seen["broken"] = await mcp.call_tool("broken_report", {"report": "q3"})
            seen["unknown"] = await mcp.call_tool("no_such_tool", {})
            seen["bad"] = await mcp.call_tool("lookup_order", {"order": "1001"})
            slow = {"dex/turn_id": "t1", "dex/tool_call_id": "slow"}
            arguments = {"order_id": "1001", "sleep": 2.0}
            seen["slow"] = await mcp.call_tool("lookup_order", arguments, meta=slow)
            await asyncio.to_thread(dex.wait, "s-stdio/t1/slow", 30)
            seen["slow_again"] = await mcp.call_tool("lookup_order", arguments, meta=slow)
        return seen

    seen = asyncio.run(scenario(client))
    lookup, refund = seen["tools"]["lookup_order"], seen["tools"]["refund_payment"]
    assert lookup.input_schema["required"] == ["order_id"]
    assert lookup.description == "Look up an order by id."
    assert (lookup.annotations.read_only_hint, lookup.annotations.idempotent_hint,
            lookup.annotations.destructive_hint) == (True, True, False)
    assert (refund.annotations.read_only_hint, refund.annotations.destructive_hint) == (
        False, True)
    assert refund.meta == {"dex/effect": "non_idempotent_write", "dex/requires_approval": True}
    assert seen["tools"]["update_address"].annotations.idempotent_hint is True

    # Given the same _meta ids twice, when the client calls, then the read ran once
    read = seen["read"]
    assert read.is_error is False and read.structured_content == {
        "order_id": "1001", "status": "shipped", "total_cents": 4599}
    assert json.loads(text_of(read)) == read.structured_content
    assert (read.meta["dex/key"], read.meta["dex/status"]) == ("s-stdio/t1/c1", "succeeded")
    assert seen["again"].structured_content == read.structured_content
    # Without ids, the key comes from the server process and the JSON-RPC request id
    plain_key = seen["plain"].meta["dex/key"]
    assert plain_key.startswith("s-stdio/mcp-") and "/rpc-" in plain_key
    assert client.get_tool_call(plain_key).result["order_id"] == "1002"

    assert seen["broken"].is_error and "report 'q3' does not exist" in text_of(seen["broken"])
    assert seen["unknown"].is_error and text_of(seen["unknown"]).startswith(TOOL_DID_NOT_RUN)
    assert seen["bad"].is_error and text_of(seen["bad"]).startswith(TOOL_DID_NOT_RUN)
    assert ledger.executions(ledger_path)["s-stdio/t1/c1"] == 1

    # A tool slower than --call-timeout: the client is told it still runs and how to ask
    # again; asked again with the same ids, it gets the result, and the tool ran once
    assert seen["slow"].is_error and "is still running after 1s" in text_of(seen["slow"])
    assert seen["slow_again"].structured_content["order_id"] == "1001"
    assert ledger.executions(ledger_path)["s-stdio/t1/slow"] == 1


def test_over_http_tokens_approvals_progress_rejections_and_retries(
    client: DexClient, http_server: str, ledger_path: Path
) -> None:
    # Given no token, a forged one, or a view token: refused before anything is read
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    assert httpx.post(http_server, json=body).status_code == 401
    forged = issue_token("another-secret", "s-http", permissions=["call"])
    assert httpx.post(http_server, json=body,
                      headers={"Authorization": f"Bearer {forged}"}).status_code == 401
    view = issue_token(SECRET, "s-http", permissions=["view"])
    refused = httpx.post(http_server, json=body, headers={"Authorization": f"Bearer {view}"})
    assert refused.status_code == 403 and "'call' permission" in refused.json()["error"]

    token = issue_token(SECRET, "s-http", approver="agent", permissions=["call"])
    progress: list[tuple[float, str | None]] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))

    async def call(name: str, arguments: dict[str, Any], call_id: str) -> Any:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                 timeout=httpx2.Timeout(10, read=None))
        async with http, Client(streamable_http_client(http_server, http_client=http)) as mcp:
            return await mcp.call_tool(name, arguments, progress_callback=on_progress,
                                       meta={"dex/turn_id": "t1", "dex/tool_call_id": call_id})

    # When the client asks for a refund, then it waits with progress, and after the timeout
    # the result says the call awaits approval, where, and how to ask again
    refund = {"charge_id": "ch_1", "amount_cents": 500}
    waiting = asyncio.run(call("refund_payment", refund, "c1"))
    text = text_of(waiting)
    assert waiting.is_error and text.startswith(AWAITING_APPROVAL), text
    assert "http://dex.example/sessions/s-http" in text and '"dex/tool_call_id": "c1"' in text
    assert progress and "awaits a person's approval" in (progress[0][1] or "")
    record = client.get_tool_call("s-http/t1/c1")
    assert record.status is CallStatus.AWAITING_APPROVAL and ledger.executions(ledger_path) == {}

    # When a person approves and the client asks again: the refund ran once
    assert client.resolve_interrupt("s-http", record.interrupt_id, approved=True)
    done = asyncio.run(call("refund_payment", refund, "c1"))
    assert done.is_error is False and done.structured_content == {
        "charge_id": "ch_1", "refunded_cents": 500}
    assert asyncio.run(call("refund_payment", refund, "c1")).structured_content == (
        done.structured_content)
    assert ledger.executions(ledger_path) == {"s-http/t1/c1": 1}

    # A rejection reaches the client as the tool's error, with the person's message
    second = client.call_tool(session_id="s-http", turn_id="t1", tool_call_id="c2",
                              tool="refund_payment", arguments=refund)
    assert client.resolve_interrupt("s-http", second.interrupt_id, approved=False,
                                    rejection_message="refunds need a manager")
    rejected = asyncio.run(call("refund_payment", refund, "c2"))
    assert rejected.is_error and "refunds need a manager" in text_of(rejected)

    # A session token cannot reach another session's calls
    other = asyncio.run(call_with_session_meta(http_server, token, "s-other"))
    assert other.is_error and "another session" in text_of(other)

    # The same JSON-RPC request sent twice on one connection (a client's retry) runs once
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2025-11-25"}
    init = httpx.post(http_server, headers=headers, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}})
    headers["Mcp-Session-Id"] = init.headers["mcp-session-id"]
    httpx.post(http_server, headers=headers,
               json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    charge = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "charge_card", "arguments": {"customer_id": "cu_1", "amount_cents": 300}}}
    answers = [sse_result(httpx.post(http_server, headers=headers, json=charge, timeout=30))
               for _ in range(2)]
    assert answers[0] == answers[1] and answers[0]["isError"] is False
    key = answers[0]["_meta"]["dex/key"]
    assert key == f"s-http/mcp-{headers['Mcp-Session-Id']}/rpc-7"
    assert ledger.executions(ledger_path)[key] == 1


async def call_with_session_meta(url: str, token: str, session: str) -> Any:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"})
    async with http, Client(streamable_http_client(url, http_client=http)) as mcp:
        return await mcp.call_tool("lookup_order", {"order_id": "1001"},
                                   meta={"dex/session_id": session})


def sse_result(response: httpx.Response) -> dict[str, Any]:
    """The JSON-RPC result of a streamable HTTP answer (JSON or an event stream)."""
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("application/json"):
        return dict(response.json()["result"])
    for line in response.text.splitlines():
        if line.startswith("data:"):
            message = json.loads(line[5:])
            if "result" in message:
                return dict(message["result"])
    raise AssertionError(response.text)


def test_without_the_mcp_extra_the_command_says_what_to_install(
    env: dict[str, str], tmp_path: Path
) -> None:
    # Given an environment where the mcp SDK cannot be imported
    (tmp_path / "mcp").mkdir()
    (tmp_path / "mcp" / "__init__.py").write_text("raise ImportError('No module named mcp')\n")
    done = subprocess.run([*dex_command(), "mcp"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(tmp_path)}, timeout=60, input="")
    # Then one line names the extra, and nothing is served
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        'error: dex_tasks.integrations.mcp_server needs the mcp extra: '
        'pip install "dex-tasks[mcp]"']
