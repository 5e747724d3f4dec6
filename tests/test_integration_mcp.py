"""The MCP adapter (issue 10): an MCP server's tools run as dex tools on real workers.

``tests/mcp_server.py`` is the MCP server (stdio, or streamable HTTP); ``tests/mcp_worker_tools``
is the worker's ``--tools`` module that wraps it with ``mcp_tools``. The server writes every
execution to the ledger with the idempotency key it received in the request's ``_meta``, and a
line each time it starts, so the tests count executions and sessions.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mcp import StdioServerParameters

from dex_tasks import (
    APPROVAL_REJECTED,
    OUTCOME_UNKNOWN_TOOL_RESULT,
    TOOL_DID_NOT_RUN,
    CallStatus,
    DexClient,
    EffectClass,
    OutcomeUnknownError,
    Tool,
    ToolCallRecord,
    ToolContext,
    ToolDefinitionError,
)
from dex_tasks.broker.celery_app import publish
from dex_tasks.integrations.mcp import MCPToolError, close_sessions, mcp_tools
from tests.conftest import StartWorker
from tests.helpers import ROOT, WorkerProcess, free_port, pid_alive, wait_until
from workers import ledger

TOOLS = "tests.mcp_worker_tools"


# How long the session sits idle after its server died before the next call.
IDLE_SECONDS = 2.0


def _call(client: DexClient, tool: str, arguments: dict[str, Any], call_id: str,
          session: str = "s-mcp", turn: str = "t1") -> ToolCallRecord:
    return client.call_tool(session_id=session, turn_id=turn, tool_call_id=call_id,
                            tool=f"shop_{tool}", arguments=arguments)


def _runs(ledger_path: Path, tool: str, key: str | None = None) -> list[dict[str, Any]]:
    """The server's executions of ``tool`` (of one key, if given)."""
    return [e for e in ledger.read(ledger_path)
            if e["tool"] == f"mcp:{tool}" and (key is None or e["key"] == key)]


def _started(ledger_path: Path, tool: str, key: str) -> dict[str, Any]:
    """Wait until the server has started running ``key``; its ledger line (pid = the server)."""
    def first() -> dict[str, Any] | None:
        runs = _runs(ledger_path, tool, key)
        return runs[0] if runs else None

    return wait_until(first, 30, f"{tool} to start for {key}")


def _ignored(worker: WorkerProcess, key: str) -> int:
    return sum(1 for line in worker.log().splitlines()
               if "action=duplicate_delivery" in line and f"key={key}" in line)


# -- on a worker, over stdio ---------------------------------------------------------------------


def test_reads_and_writes_run_on_a_worker_over_one_session_per_child(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    worker = start_worker(concurrency=2, tools=TOOLS)

    # The catalog the worker published carries the MCP tools' descriptions and schemas.
    specs = {spec.name: spec for spec in client.list_tools()}
    lookup = specs["shop_lookup_order"]
    assert lookup.description == "Look up an order by id."
    assert lookup.parameters["required"] == ["order_id"]
    assert lookup.policy.effect is EffectClass.READ and not lookup.policy.needs_approval
    assert lookup.hints == {"readOnlyHint": True}

    # Many reads: each comes back with the server's answer, and reached the server with its key.
    records = [_call(client, "lookup_order", {"order_id": f"o{i}"}, f"read-{i}")
               for i in range(12)]
    done = [client.wait(r.key, timeout=60) for r in records]
    assert [d.status for d in done] == [CallStatus.SUCCEEDED] * 12
    assert [d.result["order_id"] for d in done] == [f"o{i}" for i in range(12)]  # type: ignore[index]
    runs = _runs(ledger_path, "lookup_order")
    assert sorted(e["key"] for e in runs) == sorted(r.key for r in records)

    # One session per worker child: a stdio session is one server process, started by the
    # child on its first call and reused for every later one. (The worker's main process
    # started one more, to list the tools, and closed it before forking.)
    servers = {e["pid"] for e in runs}
    starts = [e for e in ledger.read(ledger_path) if e["tool"] == "mcp:server_start"]
    by_children = [e for e in starts if e["ppid"] != worker.pid]
    assert [e["ppid"] for e in starts].count(worker.pid) == 1
    assert 1 <= len(servers) <= 2
    assert {e["pid"] for e in by_children} == servers
    assert len({e["ppid"] for e in by_children}) == len(by_children)  # one per child

    # An idempotent write (by its annotation) runs without approval.
    address = _call(client, "set_address", {"order_id": "o1", "address": "1 Main St"}, "addr")
    assert client.wait(address.key, timeout=30).result == {"order_id": "o1",
                                                            "address": "1 Main St"}

    # A tool result with isError ends the call failed with the tool's text, not retried.
    coupon = client.wait(_call(client, "check_coupon", {"code": "SPRING"}, "coupon").key, 30)
    assert coupon.status is CallStatus.FAILED
    assert "coupon SPRING expired yesterday" in (coupon.error or "")
    assert len(_runs(ledger_path, "check_coupon")) == 1

    # Explicit policy beats the annotation: archive_order says readOnlyHint, the tools module
    # says non_idempotent_write, so it waits for a person and has not run.
    archive = _call(client, "archive_order", {"order_id": "o2"}, "archive")
    assert archive.status is CallStatus.AWAITING_APPROVAL
    assert specs["shop_archive_order"].policy.effect is EffectClass.NON_IDEMPOTENT_WRITE
    # No annotations and no policy: unclassified, which waits for a person too.
    note = _call(client, "add_note", {"order_id": "o2", "text": "fragile"}, "note")
    assert note.status is CallStatus.AWAITING_APPROVAL
    assert specs["shop_add_note"].policy.effect is EffectClass.UNCLASSIFIED
    assert _runs(ledger_path, "archive_order") == [] and _runs(ledger_path, "add_note") == []


def test_an_approval_waits_without_a_worker_and_the_write_runs_once(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    first = start_worker(concurrency=1, tools=TOOLS)
    refund = _call(client, "refund", {"order_id": "o7", "amount_cents": 500}, "refund-1")
    rejected = _call(client, "refund", {"order_id": "o8", "amount_cents": 900}, "refund-2")
    for record in (refund, rejected):
        assert record.status is CallStatus.AWAITING_APPROVAL
    assert refund.interrupt_id is not None and rejected.interrupt_id is not None

    # No worker holds the approval: the only worker goes away, and the calls still wait.
    first.kill_all()
    snapshot = client.get_agent_snapshot("s-mcp")
    assert {p.interrupt_id for p in snapshot.pending_interrupts} == {refund.interrupt_id,
                                                                      rejected.interrupt_id}
    assert client.get_tool_call(refund.key).status is CallStatus.AWAITING_APPROVAL

    # A new worker starts; a person approves one and rejects the other.
    second = start_worker(concurrency=1, tools=TOOLS)
    assert client.resolve_interrupt("s-mcp", refund.interrupt_id, True, approver="ops")
    assert not client.resolve_interrupt("s-mcp", refund.interrupt_id, True, approver="ops")
    assert client.resolve_interrupt("s-mcp", rejected.interrupt_id, False,
                                    rejection_message="refunds over 5 EUR need a manager")

    done = client.wait(refund.key, timeout=60)
    assert done.status is CallStatus.SUCCEEDED
    # The server received the call's idempotency key in _meta.
    assert done.result == {"order_id": "o7", "refunded_cents": 500, "key": refund.key}
    no = client.wait(rejected.key, timeout=10)
    assert no.status is CallStatus.REJECTED
    assert (no.error or "").startswith(APPROVAL_REJECTED)
    assert "refunds over 5 EUR need a manager" in (no.error or "")

    # Asking again, and delivering the message again, run nothing more.
    again = _call(client, "refund", {"order_id": "o7", "amount_cents": 500}, "refund-1")
    assert again.key == refund.key and again.status is CallStatus.SUCCEEDED
    row = client.store.get_call(refund.key)
    assert row is not None
    publish(client.app, row)
    wait_until(lambda: _ignored(second, refund.key) >= 1, 30, "the duplicate to be ignored")
    assert [e["key"] for e in _runs(ledger_path, "refund")] == [refund.key]


def test_a_server_killed_mid_call_ends_outcome_unknown_and_the_next_call_reconnects(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker(concurrency=1, tools=TOOLS)

    # A read: the server is SIGKILLed while it runs the call. Reads are retried after a lost
    # worker, but not here: the request reached the server, which may have acted on it.
    slow = _call(client, "wait_for", {"seconds": 60}, "slow-read")
    first_server = _started(ledger_path, "wait_for", slow.key)["pid"]
    os.kill(first_server, signal.SIGKILL)
    lost = client.wait(slow.key, timeout=30)
    assert lost.status is CallStatus.OUTCOME_UNKNOWN
    assert (lost.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert "lost after the call of 'wait_for' was sent" in (lost.error or "")

    # The next call starts a new server process and is served by it.
    after = client.wait(_call(client, "lookup_order", {"order_id": "o2"}, "after").key, 60)
    assert after.status is CallStatus.SUCCEEDED
    second_server = after.result["server_pid"]  # type: ignore[index]
    assert second_server != first_server

    # The server dies while the session is idle: the next call sees the closed session before
    # sending anything, so it is not lost; a new session serves it. (Idle for a while: the
    # worker's session notices the closed pipe on its own event loop, not at once.)
    os.kill(second_server, signal.SIGKILL)
    wait_until(lambda: not pid_alive(second_server), 10, "the idle server to be gone")
    assert after.finished_at is not None
    wait_until(lambda: time.time() - after.finished_at.timestamp()  # type: ignore[union-attr]
               > IDLE_SECONDS, 10, "the session to be idle")
    idle = client.wait(_call(client, "lookup_order", {"order_id": "o3"}, "idle").key, 60)
    assert idle.status is CallStatus.SUCCEEDED, idle.error
    assert idle.attempts == 1  # served by the adapter's new session, not by a dex retry
    third_server = idle.result["server_pid"]  # type: ignore[index]
    assert third_server not in (first_server, second_server)

    # A write that needs no approval (explicit policy), killed mid-call: the same on the
    # single-attempt path.
    ship = _call(client, "ship_order", {"order_id": "o4", "seconds": 60}, "ship")
    assert ship.status is CallStatus.QUEUED
    os.kill(_started(ledger_path, "ship_order", ship.key)["pid"], signal.SIGKILL)
    assert client.wait(ship.key, timeout=30).status is CallStatus.OUTCOME_UNKNOWN

    # Each lost call reached the server exactly once.
    assert len(_runs(ledger_path, "wait_for", slow.key)) == 1
    assert len(_runs(ledger_path, "ship_order", ship.key)) == 1


# -- on a worker, over streamable HTTP -----------------------------------------------------------


class HttpServer:
    """``tests/mcp_server.py`` on streamable HTTP, which the test stops and starts again."""

    def __init__(self, port: int, env: dict[str, str], log: Path, *args: str) -> None:
        self.port = port
        self.env = env
        self.log = log
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> HttpServer:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.mcp_server", "--http", str(self.port), *self.args],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        wait_until(self._listening, 30, f"the MCP server on port {self.port}")
        return self

    def _listening(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the MCP server exited:\n{self.log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
        except OSError:
            return False
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def http_server(env: dict[str, str], tmp_path: Path) -> Iterator[HttpServer]:
    server = HttpServer(free_port(), env, tmp_path / "mcp-http.log").start()
    yield server
    server.kill()


def test_over_http_a_lost_call_is_unknown_an_unreachable_server_did_not_run_and_a_restart_serves(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, http_server: HttpServer
) -> None:
    start_worker(concurrency=1, tools=TOOLS, extra_env={"DEX_TEST_MCP_URL": http_server.url})
    first = client.wait(_call(client, "lookup_order", {"order_id": "o1"}, "h1").key, 60)
    assert first.status is CallStatus.SUCCEEDED and first.result["order_id"] == "o1"  # type: ignore[index]
    # The headers given to mcp_tools reach the server with each request.
    assert [e["shop_token"] for e in _runs(ledger_path, "lookup_order")] == ["t0ken"]

    # Killed while the request is on the server: outcome unknown.
    slow = _call(client, "wait_for", {"seconds": 60}, "h-slow")
    _started(ledger_path, "wait_for", slow.key)
    http_server.kill()
    lost = client.wait(slow.key, timeout=30)
    assert lost.status is CallStatus.OUTCOME_UNKNOWN, lost.error

    # While it is down, a call cannot connect: it did not run (a read retries, then fails).
    down = client.wait(_call(client, "lookup_order", {"order_id": "o2"}, "h-down").key, 60)
    assert down.status is CallStatus.FAILED
    assert TOOL_DID_NOT_RUN in (down.error or "") and "could not connect" in (down.error or "")
    assert _runs(ledger_path, "lookup_order", down.key) == []

    # Restarted on the same address, it serves the next call.
    http_server.start()
    back = client.wait(_call(client, "lookup_order", {"order_id": "o3"}, "h-back").key, 60)
    assert back.status is CallStatus.SUCCEEDED and back.result["order_id"] == "o3"  # type: ignore[index]

    # Stopped between two calls, while the session is open and idle: the next request cannot
    # connect, so it is known not to have run (failed, not outcome_unknown).
    http_server.kill()
    idle = client.wait(_call(client, "lookup_order", {"order_id": "o4"}, "h-idle").key, 60)
    assert idle.status is CallStatus.FAILED and TOOL_DID_NOT_RUN in (idle.error or "")
    assert _runs(ledger_path, "lookup_order", idle.key) == []


def test_a_restarted_http_server_that_forgot_the_session_serves_the_next_call(
    env: dict[str, str], tmp_path: Path
) -> None:
    # Given a 2025-protocol server, whose HTTP session id dies with the process
    server = HttpServer(free_port(), env, tmp_path / "legacy.log", "--legacy").start()
    try:
        tools = {t.name: t for t in mcp_tools(server.url, prefix="legacy_")}
        lookup = tools["legacy_lookup_order"]
        assert lookup(_ctx("l1"), order_id="A")["order_id"] == "A"
        # When it restarts, it answers the open session's next request with 404
        server.kill()
        server.start()
        # Then the request did not run, and the adapter sends it again on a new session
        assert lookup(_ctx("l2"), order_id="B")["order_id"] == "B"
        assert [e["key"] for e in ledger.read(server.env[ledger.ENV])
                if e["tool"] == "mcp:lookup_order"] == ["l1", "l2"]
    finally:
        close_sessions()
        server.kill()


def _ctx(key: str) -> ToolContext:
    return ToolContext(idempotency_key=key, session_id="s", turn_id="t", tool_call_id=key,
                       attempt=1)


# -- in this process: definitions, results, bad input --------------------------------------------


@dataclass
class Local:
    """The test server's tools, defined in this process (prefix ``local_``, timeout 3 s)."""

    server: StdioServerParameters
    tools: dict[str, Tool[Any]]
    ledger: Path

    def call(self, name: str, key: str, **arguments: Any) -> Any:
        return self.tools[f"local_{name}"](_ctx(key), **arguments)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Local]:
    # One listing for the tests below: a stdio server takes a second or two to start.
    path = tmp_path_factory.mktemp("mcp-local") / "ledger.jsonl"
    server = StdioServerParameters(command=sys.executable, args=["-m", "tests.mcp_server"],
                                   cwd=str(ROOT), env={ledger.ENV: str(path)})
    tools = mcp_tools(server, prefix="local_", timeout=3, policies={
        "archive_order": "non_idempotent_write",          # by its MCP name
        "local_set_address": EffectClass.READ,            # by its dex name
    })
    yield Local(server, {t.name: t for t in tools}, path)
    close_sessions()


def test_policies_beat_annotations_which_beat_unclassified(client: DexClient,
                                                           local: Local) -> None:
    assert sorted(local.tools) == [
        "local_add_note", "local_archive_order", "local_check_coupon", "local_lookup_order",
        "local_refund", "local_set_address", "local_ship_order", "local_wait_for"]
    specs = {s.name: s for s in client.list_tools() if s.name.startswith("local_")}
    effect = {name: spec.policy.effect for name, spec in specs.items()}
    assert effect["local_archive_order"] is EffectClass.NON_IDEMPOTENT_WRITE  # policy > hint
    assert effect["local_set_address"] is EffectClass.READ                    # policy > hint
    assert effect["local_lookup_order"] is EffectClass.READ                   # hint
    assert effect["local_refund"] is EffectClass.NON_IDEMPOTENT_WRITE         # hint
    assert effect["local_add_note"] is EffectClass.UNCLASSIFIED               # nothing
    assert specs["local_archive_order"].hints == {"readOnlyHint": True}       # kept, not used
    assert specs["local_refund"].policy.needs_approval
    assert not specs["local_lookup_order"].policy.needs_approval
    # A session's default effect comes after the annotations too.
    defaulted = {s.name: s.policy.effect for s in client.list_tools(default_effect="read")}
    assert defaulted["local_add_note"] is EffectClass.READ
    assert defaulted["local_refund"] is EffectClass.NON_IDEMPOTENT_WRITE


def test_results_and_errors_of_a_direct_call(local: Local) -> None:
    # A JSON object sent as text content is parsed; structured content (MCPServer wraps a str
    # return as {"result": ...}) is the result as sent; isError raises with the tool's text.
    assert local.call("lookup_order", "k1", order_id="A1")["order_id"] == "A1"
    assert local.call("add_note", "k2", order_id="A1", text="hi") == {"result": "noted on A1: hi"}
    with pytest.raises(MCPToolError, match="coupon X expired yesterday"):
        local.call("check_coupon", "k3", code="X")
    # Every request carried its idempotency key to the server.
    assert [e["key"] for e in ledger.read(local.ledger) if e["key"].startswith("k")] == [
        "k1", "k2", "k3"]


def test_no_answer_within_the_timeout_is_an_unknown_outcome(local: Local) -> None:
    with pytest.raises(OutcomeUnknownError, match=r"no answer to 'wait_for' within 3\.0s"):
        local.call("wait_for", "k-slow", seconds=10)
    # The session is still good for the next call.
    assert local.call("lookup_order", "k-next", order_id="B")["order_id"] == "B"


def test_bad_definitions_are_refused_with_the_reason(local: Local) -> None:
    server = local.server
    with pytest.raises(ToolDefinitionError, match=r"policies\['refund'\]: effect 'sometimes'"):
        mcp_tools(server, prefix="bad1_", policies={"refund": "sometimes"})
    with pytest.raises(ToolDefinitionError, match="server must be a URL"):
        mcp_tools(42, prefix="bad2_")  # type: ignore[arg-type]
    with pytest.raises(ToolDefinitionError, match="timeout must be a positive number"):
        mcp_tools(server, prefix="bad3_", timeout=0)
    with pytest.raises(ToolDefinitionError, match="headers= applies to an HTTP server only"):
        mcp_tools(server, prefix="bad4_", headers={"Authorization": "x"})
    # An unreachable server is named in the error, without the URL's credentials or query.
    nowhere = f"http://127.0.0.1:{free_port()}/mcp"
    with pytest.raises(ToolDefinitionError, match="could not list the tools of " +
                       re.escape(nowhere) + ": ConnectError") as refused:
        mcp_tools(nowhere.replace("//", "//user:pw@") + "?token=s3cret", prefix="bad5_",
                  connect_timeout=5)
    assert "s3cret" not in str(refused.value) and "pw" not in str(refused.value)
    # These two need the server's list.
    with pytest.raises(ToolDefinitionError, match=r"'nope', which is not a tool of .*lookup_order"):
        mcp_tools(server, prefix="bad6_", policies={"nope": "read"})
    with pytest.raises(ToolDefinitionError, match=r"'local_lookup_order' .* is already defined"):
        mcp_tools(server, prefix="local_")


# -- the example ---------------------------------------------------------------------------------


def test_the_example_runs_as_its_docstring_says(
    client: DexClient, start_worker: StartWorker, env: dict[str, str]
) -> None:
    # The agent snippet of examples/mcp_tools.py's docstring, run as written against a worker
    # that serves the example's tools.
    source = (ROOT / "examples" / "mcp_tools.py").read_text()
    doc = ast.get_docstring(ast.parse(source)) or ""
    snippet = textwrap.dedent(doc.split("python - <<'EOF'\n", 1)[1].split("EOF", 1)[0])
    start_worker(concurrency=1, tools="examples.mcp_tools")
    agent = subprocess.run([sys.executable, "-"], input=snippet, text=True, cwd=ROOT, env=env,
                           capture_output=True, timeout=90)
    assert agent.returncode == 0, agent.stderr
    lines = agent.stdout.splitlines()
    assert lines[0].startswith("lookup: {'order_id': '1001', 'status': 'shipped'")
    assert lines[1] == "refund: awaiting_approval"
    assert lines[2] == ("refund: {'charge_id': 'ch_1001', 'refunded_cents': 500, "
                        "'idempotency_key': 'mcp-demo/t1/c2', 'duplicate': False}")
    specs = {s.name: s.policy.effect for s in client.list_tools()}
    assert specs["orders_add_note"] is EffectClass.IDEMPOTENT_WRITE
    assert specs["orders_update_address"] is EffectClass.IDEMPOTENT_WRITE
