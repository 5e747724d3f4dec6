"""Bodies are read after tokens, and never past 64 KiB (issue 11, item 8), on a real socket.

Each request here is written by hand to a real uvicorn (with Redis and, where a decision could
run a tool, a real worker): headers first, then as much of the body
as the test chooses, often none of it. An answer that arrives while the body is still unsent
proves the server did not read it; a server that read bodies first would wait for bytes that
never come, and the socket's timeout fails the test.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

import workers.example_tools  # noqa: F401 - registers refund_payment in this process
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.api import create_api
from dex_tasks.tokens import issue_token
from tests.conftest import StartWorker
from tests.helpers import served
from workers import ledger

SESSION = "sess-limits"
SECRET = "test-secret-key"  # tests.conftest.fast_settings
LIMIT = 64 * 1024
# How long a test waits for an answer the server must give without the body.
ANSWER_TIMEOUT = 15.0


@pytest.fixture
def base_url(settings: DexSettings) -> Iterator[str]:
    with served(create_api(settings)) as url:
        yield url


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class RawRequest:
    """One HTTP/1.1 request written by hand; the body is sent only when the test says so."""

    def __init__(self, base_url: str, method: str, path: str, headers: dict[str, str]) -> None:
        parts = urlsplit(base_url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
        lines = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}",
                 *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        self.sock.sendall("\r\n".join(lines).encode())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_chunk(self, data: bytes) -> None:
        self.sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def answer(self, timeout: float = ANSWER_TIMEOUT) -> Answer:
        """The response, read within ``timeout`` (socket.timeout if none comes)."""
        self.sock.settimeout(timeout)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before a response: {data!r}")
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (h.partition(":") for h in header_lines)}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return Answer(int(status_line.split()[1]), headers, body[:length])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw(base_url: str) -> Iterator[Any]:
    opened: list[RawRequest] = []

    def open_request(method: str, path: str, headers: dict[str, str]) -> RawRequest:
        request = RawRequest(base_url, method, path, headers)
        opened.append(request)
        return request

    yield open_request
    for request in opened:
        request.close()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _pending(client: DexClient) -> Any:
    record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c1",
                              tool="refund_payment",
                              arguments={"charge_id": "ch_1", "amount_cents": 500})
    assert record.status is CallStatus.AWAITING_APPROVAL
    return record


def _still_waiting(client: DexClient, record: Any) -> None:
    assert client.get_tool_call(record.key).status is CallStatus.AWAITING_APPROVAL
    assert client.get_agent_snapshot(SESSION).decided == []


def test_the_token_is_checked_before_a_byte_of_the_body_is_read(
    raw: Any, client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a real worker ready to run the call the moment anyone approves it
    start_worker(concurrency=1)
    record = _pending(client)
    json_body = {"Content-Type": "application/json"}
    forged = issue_token("another-secret-key", SESSION)
    view = issue_token(SECRET, SESSION, permissions=["view"])
    cases = [
        ("no token", {}, 401),
        ("forged token", _bearer(forged), 401),
        ("malformed token", _bearer("not-a-token"), 401),
        ("view token", _bearer(view), 403),
    ]
    for name, auth, expected in cases:
        # A small declared body, none of it sent: the answer cannot depend on it.
        declared = raw("POST", "/interrupts/resolve",
                       {**auth, **json_body, "Content-Length": "120"})
        answer = declared.answer()
        assert answer.status == expected, (name, answer)
        assert "detail" in answer.json(), name
        # A chunked body, one chunk sent and never finished.
        chunked = raw("POST", "/interrupts/resolve",
                      {**auth, **json_body, "Transfer-Encoding": "chunked"})
        chunked.send_chunk(b'{"interrupt_id": ')
        assert chunked.answer().status == expected, name
    _still_waiting(client, record)
    assert ledger.executions(ledger_path)[record.key] == 0

    # Control: with a genuine operate token the route does read the body, so the same
    # half-sent request gets its answer only once the rest arrives.
    operate = raw("POST", "/interrupts/resolve",
                  {**_bearer(issue_token(SECRET, SESSION)), **json_body,
                   "Transfer-Encoding": "chunked"})
    operate.send_chunk(b'{"interrupt_id": "' + record.interrupt_id.encode() + b'", ')
    with pytest.raises(TimeoutError):
        operate.answer(timeout=0.5)
    operate.send_chunk(b'"approved": true, "rejection_message": null}')
    operate.send(b"0\r\n\r\n")
    answer = operate.answer()
    assert (answer.status, answer.json()) == (200, {"accepted": True})
    assert client.wait(record.key, 20).status is CallStatus.SUCCEEDED
    assert ledger.executions(ledger_path)[record.key] == 1


def test_a_forged_token_with_a_bad_body_gets_401_not_400(raw: Any, client: DexClient) -> None:
    record = _pending(client)
    for body in (b'{"approved": "yes"}', b"not json at all", b"[1, 2, 3]"):
        request = raw("POST", "/interrupts/resolve",
                      {**_bearer(issue_token("another-secret-key", SESSION)),
                       "Content-Type": "application/json", "Content-Length": str(len(body))})
        request.send(body)
        answer = request.answer()
        assert answer.status == 401, (body, answer)
        assert answer.headers["www-authenticate"].startswith("Bearer")
    _still_waiting(client, record)


def test_a_declared_body_over_64_kib_gets_413_before_it_is_sent(
    raw: Any, client: DexClient
) -> None:
    record = _pending(client)
    operate = _bearer(issue_token(SECRET, SESSION))
    view = _bearer(issue_token(SECRET, SESSION, permissions=["view"]))
    for method, path, auth in (("POST", "/interrupts/resolve", operate),
                               ("POST", "/interrupts/resolve", {}),  # no token: not read either
                               ("GET", f"/sessions/{SESSION}/snapshot", view),
                               ("GET", f"/sessions/{SESSION}", view),
                               ("GET", "/healthz", {})):
        for declared in (LIMIT + 1, 11 * 1024 * 1024, 10**15):
            request = raw(method, path, {**auth, "Content-Type": "application/json",
                                         "Content-Length": str(declared)})
            answer = request.answer()
            assert answer.status == 413, (path, declared, answer)
            assert answer.json() == {"error": f"the request body is larger than {LIMIT} bytes"}
            assert answer.headers["connection"] == "close"
    # Exactly the limit is allowed (and then read: a bad body, 400).
    body = b'{"interrupt_id": "' + b"x" * (LIMIT - 40) + b'"}'
    body = body + b" " * (LIMIT - len(body))
    request = raw("POST", "/interrupts/resolve", {**operate, "Content-Length": str(LIMIT)})
    request.send(body)
    answer = request.answer()
    assert (answer.status, answer.json()) \
        == (400, {"error": "interrupt_id must be at most 64 characters, got 65496"})
    _still_waiting(client, record)


def test_a_chunked_body_over_64_kib_gets_413_without_waiting_for_its_end(
    raw: Any, client: DexClient
) -> None:
    record = _pending(client)
    request = raw("POST", "/interrupts/resolve",
                  {**_bearer(issue_token(SECRET, SESSION)), "Content-Type": "application/json",
                   "Transfer-Encoding": "chunked"})
    request.send_chunk(b'{"interrupt_id": "' + record.interrupt_id.encode()
                       + b'", "approved": true, "rejection_message": "')
    for _ in range(LIMIT // 4096 + 1):
        request.send_chunk(b"m" * 4096)
    # The body is still open (no last chunk): the 413 comes from counting, not from the end.
    answer = request.answer()
    assert answer.status == 413, answer
    assert answer.json() == {"error": f"the request body is larger than {LIMIT} bytes"}
    _still_waiting(client, record)


def test_routes_without_a_body_never_read_one(raw: Any, client: DexClient) -> None:
    record = _pending(client)
    view = _bearer(issue_token(SECRET, SESSION, permissions=["view"]))
    # A GET declaring a body it never sends is answered all the same: nobody waits for it.
    request = raw("GET", f"/sessions/{SESSION}/snapshot", {**view, "Content-Length": "500"})
    answer = request.answer()
    assert answer.status == 200, answer
    assert [p["interrupt_id"] for p in answer.json()["pending_interrupts"]] \
        == [record.interrupt_id]
    chunked = raw("GET", f"/sessions/{SESSION}/snapshot", {**view, "Transfer-Encoding": "chunked"})
    chunked.send_chunk(b"x" * 1000)
    assert chunked.answer().status == 200


def test_a_content_length_that_is_not_a_number_gets_400(raw: Any) -> None:
    request = raw("POST", "/interrupts/resolve",
                  {**_bearer(issue_token(SECRET, SESSION)), "Content-Length": "-5"})
    answer = request.answer()
    # uvicorn's parser may refuse it first (400 as well); either way nothing is read.
    assert answer.status == 400
