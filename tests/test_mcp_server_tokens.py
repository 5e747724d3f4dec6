"""Who may do what through ``dex-tasks mcp`` (issue 28 items 2, 9, 10 and the per-token cap),
against real ``dex-tasks mcp --http`` and ``dex-tasks api`` processes and a real worker:

* calling tools and deciding approvals are separate permissions: the MCP server admits only
  ``call`` tokens (a person's ``operate`` token gets 403 there), a ``call`` token gets 403 from
  ``POST /interrupts/resolve``, and the identity that made a call cannot decide it, whatever
  its token holds, unless the tool's policy sets ``allow_self_approval``;
* an MCP HTTP session belongs to the token that opened it: another token using it or deleting
  it gets 404 and changes nothing;
* on stdio, ``--session`` pins the session: a client's ``_meta`` naming another is refused;
* one token may hold at most ``--max-sessions-per-token`` sessions and
  ``--max-requests-per-token`` requests in progress (429 past either), so it cannot use up the
  server's session limit that every other token shares.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client
from mcp.client.stdio import stdio_client
from typer.testing import CliRunner

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    CallStatus,
    DexClient,
    SelfApprovalError,
    ToolContext,
    issue_token,
    read_token,
    token_identity,
    tool,
)
from dex_tasks.ops.cli import app as cli_app
from tests.conftest import StartWorker
from tests.helpers import free_port, start_process, wait_until
from tests.test_mcp_server import SECRET, sse_result, stdio_params, text_of
from workers import ledger

PROTOCOL = "2025-11-25"
REFUND = {"charge_id": "ch_9", "amount_cents": 700}


def start_server(args: list[str], env: dict[str, str], log: Path,
                 probe: Callable[[], bool]) -> Any:
    proc = start_process(args, env, log)

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return probe()
        except httpx.TransportError:
            return False

    wait_until(up, 60, f"dex-tasks {args[0]} to listen")
    return proc


@pytest.fixture
def servers(env: dict[str, str], tmp_path: Path, start_worker: StartWorker
            ) -> Iterator[tuple[str, str]]:
    """``dex-tasks mcp --http`` (its default caps) and ``dex-tasks api``, and a worker; yields
    (the MCP URL, the API URL)."""
    mcp_port, api_port = free_port(), free_port()
    worker = start_worker(concurrency=2, wait=False)
    mcp_url, api_url = f"http://127.0.0.1:{mcp_port}/mcp", f"http://127.0.0.1:{api_port}"
    procs = [
        start_server(["mcp", "--http", "--port", str(mcp_port), "--approval-timeout", "1"],
                     env, tmp_path / "mcp.log", lambda: httpx.get(mcp_url).status_code == 401),
        start_server(["api", "--port", str(api_port)], env, tmp_path / "api.log",
                     lambda: httpx.get(f"{api_url}/healthz").status_code < 500),
    ]
    worker.wait_ready()
    yield mcp_url, api_url
    for proc in procs:
        proc.kill()
        proc.wait(10)


def stored(client: DexClient, key: str) -> Any:
    """The stored row of ``key``, or None: was anything recorded under it?"""
    return client.store.get_call(key)


def cli_token(env: dict[str, str], *args: str) -> str:
    done = CliRunner().invoke(cli_app, ["token", *args], env=env)
    assert done.exit_code == 0, done.output
    return done.stdout.strip()


def bearer(token: str, session: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}", "MCP-Protocol-Version": PROTOCOL,
               "Accept": "application/json, text/event-stream"}
    if session is not None:
        headers["Mcp-Session-Id"] = session
    return headers


def open_session(url: str, token: str) -> httpx.Response:
    """The handshake's initialize request; on success its answer carries the session id."""
    return httpx.post(url, headers=bearer(token), timeout=30, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": PROTOCOL, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}})


def session_of(url: str, token: str) -> str:
    opened = open_session(url, token)
    assert opened.status_code == 200, opened.text
    sid = opened.headers["mcp-session-id"]
    done = httpx.post(url, headers=bearer(token, sid), timeout=30,
                      json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert done.status_code == 202, done.text
    return sid


def tools_call(url: str, token: str, sid: str, rpc_id: int, name: str,
               arguments: dict[str, Any], meta: dict[str, Any] | None = None) -> httpx.Response:
    params: dict[str, Any] = {"name": name, "arguments": arguments}
    if meta:
        params["_meta"] = meta
    return httpx.post(url, headers=bearer(token, sid), timeout=60, json={
        "jsonrpc": "2.0", "id": rpc_id, "method": "tools/call", "params": params})


def resolve(api: str, token: str, interrupt_id: str, approved: bool = True) -> httpx.Response:
    return httpx.post(f"{api}/interrupts/resolve", headers={"Authorization": f"Bearer {token}"},
                      json={"interrupt_id": interrupt_id, "approved": approved}, timeout=30)


def test_calling_tools_and_deciding_approvals_are_separate_permissions(
    client: DexClient, servers: tuple[str, str], env: dict[str, str], ledger_path: Path
) -> None:
    mcp, api = servers
    person = cli_token(env, "s-sep", "--approver", "alice")  # operate, as before

    # Given a person's operate token, the MCP server refuses it before anything is read: the
    # token that decides approvals is not the one an MCP client holds
    refused = open_session(mcp, person)
    assert refused.status_code == 403 and "'call' permission" in refused.json()["error"]
    agent = cli_token(env, "s-sep", "--permission", "call", "--approver", "agent")

    # Given the agent's call token, when its client asks for a refund, then it waits
    sid = session_of(mcp, agent)
    waiting = sse_result(tools_call(mcp, agent, sid, 1, "refund_payment", REFUND,
                                    {"dex/turn_id": "t1", "dex/tool_call_id": "c1"}))
    assert waiting["isError"] and waiting["_meta"]["dex/status"] == "awaiting_approval"
    record = client.get_tool_call("s-sep/t1/c1")
    assert record.status is CallStatus.AWAITING_APPROVAL
    interrupt = record.interrupt_id
    assert interrupt is not None

    # When the agent's own token tries to approve: 403, the call still waits
    denied = resolve(api, agent, interrupt)
    assert denied.status_code == 403 and "operate" in denied.json()["detail"], denied.text
    # ...nor read the session: call grants nothing on the API
    assert httpx.get(f"{api}/sessions/s-sep/snapshot", timeout=30,
                     headers={"Authorization": f"Bearer {agent}"}).status_code == 403
    # A person's token minted under the agent's name is the identity that made the call: 403
    same_name = cli_token(env, "s-sep", "--approver", "agent")
    self_approval = resolve(api, same_name, interrupt)
    assert self_approval.status_code == 403, self_approval.text
    assert "agent made this call" in self_approval.json()["detail"]
    assert "allow_self_approval" in self_approval.json()["detail"]
    # Rejecting is a decision too: refused to the caller
    assert resolve(api, same_name, interrupt, approved=False).status_code == 403
    assert client.get_tool_call("s-sep/t1/c1").status is CallStatus.AWAITING_APPROVAL

    # A token that holds both (issued by hand, unnamed) calls, then tries to approve the call it
    # made: the token itself is the identity, refused
    both = issue_token(SECRET, "s-sep", permissions=["call", "operate"])
    sid_both = session_of(mcp, both)
    sse_result(tools_call(mcp, both, sid_both, 1, "refund_payment", REFUND,
                          {"dex/turn_id": "t1", "dex/tool_call_id": "c2"}))
    own = client.get_tool_call("s-sep/t1/c2")
    assert own.interrupt_id is not None
    assert own.status is CallStatus.AWAITING_APPROVAL
    refused_own = resolve(api, both, own.interrupt_id)
    assert refused_own.status_code == 403, refused_own.text
    assert token_identity(both, read_token(SECRET, both)) in refused_own.json()["detail"]

    # When the person approves, the refund runs once and the agent's client gets it
    assert resolve(api, person, interrupt).json() == {"accepted": True}
    done = sse_result(tools_call(mcp, agent, sid, 2, "refund_payment", REFUND,
                                 {"dex/turn_id": "t1", "dex/tool_call_id": "c1"}))
    assert done["isError"] is False and done["structuredContent"]["refunded_cents"] == 700
    assert ledger.executions(ledger_path) == {"s-sep/t1/c1": 1}


def test_a_policy_that_allows_self_approval_lets_the_caller_decide(client: DexClient) -> None:
    @tool(effect="non_idempotent_write", name="self_approved_note", allow_self_approval=True)
    def self_approved_note(ctx: ToolContext, text: str) -> str:
        return text

    @tool(effect="non_idempotent_write", name="person_approved_note")
    def person_approved_note(ctx: ToolContext, text: str) -> str:
        return text

    def call(name: str, call_id: str) -> str:
        record = client.call_tool(session_id="s-self", turn_id="t", tool_call_id=call_id,
                                  tool=name, arguments={"text": "hi"}, requested_by="bot")
        assert record.status is CallStatus.AWAITING_APPROVAL and record.interrupt_id
        return record.interrupt_id

    # Given the same caller, a tool without the setting refuses its decision...
    refused = call("person_approved_note", "c1")
    with pytest.raises(SelfApprovalError, match="bot made this call"):
        client.resolve_interrupt("s-self", refused, True, approver="bot")
    assert client.get_tool_call("s-self/t/c1").status is CallStatus.AWAITING_APPROVAL
    # ...and another person decides it
    assert client.resolve_interrupt("s-self", refused, True, approver="alice")
    # Given allow_self_approval, the caller's own approval is accepted
    assert client.resolve_interrupt("s-self", call("self_approved_note", "c2"), True,
                                    approver="bot")
    assert client.get_tool_call("s-self/t/c2").status is CallStatus.QUEUED


def test_an_mcp_session_belongs_to_the_token_that_opened_it(
    client: DexClient, servers: tuple[str, str], ledger_path: Path
) -> None:
    mcp, _ = servers
    owner = issue_token(SECRET, "s-owner", permissions=["call"], approver="owner")
    other = issue_token(SECRET, "s-thief", permissions=["call"], approver="thief")
    sid = session_of(mcp, owner)

    # Given another session's token that learned the session id, when it calls a tool on it
    # or deletes it: 404, as if the session did not exist, and nothing was recorded or run
    used = tools_call(mcp, other, sid, 5, "lookup_order", {"order_id": "1001"})
    assert used.status_code == 404, used.text
    listed = httpx.post(mcp, headers=bearer(other, sid), timeout=30,
                        json={"jsonrpc": "2.0", "id": 6, "method": "tools/list"})
    assert listed.status_code == 404
    assert httpx.delete(mcp, headers=bearer(other, sid), timeout=30).status_code == 404
    assert stored(client, f"s-thief/mcp-{sid}/rpc-5") is None
    assert stored(client, f"s-owner/mcp-{sid}/rpc-5") is None
    assert ledger.executions(ledger_path) == {}

    # The same holds for a second token of the same session: the session is the token's
    twin = issue_token(SECRET, "s-owner", permissions=["call"], approver="owner")
    assert twin != owner  # another expiry, another token
    assert tools_call(mcp, twin, sid, 7, "lookup_order", {"order_id": "1001"}
                      ).status_code == 404

    # The owner's session still works, and the owner may delete it
    answer = sse_result(tools_call(mcp, owner, sid, 8, "lookup_order", {"order_id": "1001"}))
    assert answer["structuredContent"]["order_id"] == "1001"
    assert answer["_meta"]["dex/key"] == f"s-owner/mcp-{sid}/rpc-8"
    assert httpx.delete(mcp, headers=bearer(owner, sid), timeout=30).status_code == 200


def test_one_token_cannot_hold_every_session(servers: tuple[str, str]) -> None:
    mcp, _ = servers
    greedy = issue_token(SECRET, "s-greedy", permissions=["call"])
    polite = issue_token(SECRET, "s-polite", permissions=["call"])
    # Given the default cap of 16 sessions per token, one token opens 16...
    sessions = [session_of(mcp, greedy) for _ in range(16)]
    # ...then its 17th is refused with 429, before the SDK opens anything
    refused = open_session(mcp, greedy)
    assert refused.status_code == 429, refused.text
    assert "16 MCP sessions open" in refused.json()["error"] and refused.headers["retry-after"]
    # Another token still gets sessions: the server's limit was not used up by the first
    assert session_of(mcp, polite)
    # Closing one of its sessions gives the first token room for another
    assert httpx.delete(mcp, headers=bearer(greedy, sessions[0]), timeout=30).status_code == 200
    assert session_of(mcp, greedy)


def test_the_per_token_caps_are_options(
    client: DexClient, env: dict[str, str], tmp_path: Path, start_worker: StartWorker
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    worker = start_worker(concurrency=2, wait=False)
    proc = start_server(["mcp", "--http", "--port", str(port), "--approval-timeout", "120",
                         "--max-sessions", "3", "--max-sessions-per-token", "2",
                         "--max-requests-per-token", "2"],
                        env, tmp_path / "mcp.log", lambda: httpx.get(url).status_code == 401)
    worker.wait_ready()
    try:
        greedy = issue_token(SECRET, "s-caps", permissions=["call"])
        polite = issue_token(SECRET, "s-caps", permissions=["call"], approver="polite")
        # Sessions: two for the first token, its third refused; the other token gets the last
        mine = [session_of(url, greedy), session_of(url, greedy)]
        assert open_session(url, greedy).status_code == 429
        assert session_of(url, polite)

        # Requests: two tools/call of the token wait for a person...
        answers: list[httpx.Response] = []

        def waiting_call(i: int) -> None:
            answers.append(tools_call(url, greedy, mine[i], 1, "refund_payment", REFUND,
                                      {"dex/turn_id": "caps", "dex/tool_call_id": f"c{i}"}))

        threads = [threading.Thread(target=waiting_call, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        keys = ["s-caps/caps/c0", "s-caps/caps/c1"]
        wait_until(lambda: all(stored(client, k) is not None for k in keys), 60,
                   "both calls to wait for approval")
        # ...so its third request is refused while they wait, and nothing more is recorded
        third = tools_call(url, greedy, mine[0], 2, "lookup_order", {"order_id": "1001"})
        assert third.status_code == 429 and "2 requests in progress" in third.json()["error"]
        assert stored(client, f"s-caps/mcp-{mine[0]}/rpc-2") is None
        # When a person approves them, their requests end and the token may ask again
        for key in keys:
            interrupt = client.get_tool_call(key).interrupt_id
            assert interrupt is not None
            assert client.resolve_interrupt("s-caps", interrupt, True, approver="alice")
        for thread in threads:
            thread.join(120)
        assert [sse_result(a)["isError"] for a in answers] == [False, False]
        again = sse_result(tools_call(url, greedy, mine[0], 3, "lookup_order",
                                      {"order_id": "1001"}))
        assert again["structuredContent"]["order_id"] == "1001"
    finally:
        proc.kill()
        proc.wait(10)


def test_on_stdio_session_pins_the_session(
    client: DexClient, start_worker: StartWorker, env: dict[str, str]
) -> None:
    start_worker(concurrency=2)

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with Client(stdio_client(stdio_params(env, "--session", "s-pinned"))) as mcp:
            seen["other"] = await mcp.call_tool(
                "lookup_order", {"order_id": "1001"},
                meta={"dex/session_id": "s-elsewhere", "dex/turn_id": "t",
                      "dex/tool_call_id": "c1"})
            seen["same"] = await mcp.call_tool(
                "lookup_order", {"order_id": "1001"},
                meta={"dex/session_id": "s-pinned", "dex/turn_id": "t",
                      "dex/tool_call_id": "c2"})
        return seen

    seen = asyncio.run(scenario())
    # Given a server pinned to s-pinned, a client's _meta naming another session is refused,
    # and nothing is recorded in either session
    other = seen["other"]
    assert other.is_error and text_of(other).startswith(TOOL_DID_NOT_RUN)
    assert "s-pinned" in text_of(other) and "s-elsewhere" in text_of(other)
    assert stored(client, "s-elsewhere/t/c1") is None
    assert stored(client, "s-pinned/t/c1") is None
    # Naming the pinned session itself is fine
    assert seen["same"].is_error is False
    assert seen["same"].meta["dex/key"] == "s-pinned/t/c2"
