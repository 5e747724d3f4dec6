"""The HTTP API: guarantee 8 (only the right people approve), body validation, resolve semantics.

FastAPI's TestClient drives the real app against a real store and Redis; the approve ->
succeeded story runs a real worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

import workers.example_tools  # noqa: F401 - registers refund_payment in this process
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.api import create_api
from dex_tasks.tokens import issue_token
from tests.conftest import StartWorker

SESSION = "sess-api"
SECRET = "test-secret-key"  # tests.conftest.fast_settings


@pytest.fixture
def http(settings: DexSettings) -> Iterator[TestClient]:
    assert settings.secret_key.get_secret_value() == SECRET
    with TestClient(create_api(settings)) as test_client:
        yield test_client


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _refund(client: DexClient, call_id: str = "c1", session: str = SESSION) -> Any:
    record = client.call_tool(session_id=session, turn_id="t1", tool_call_id=call_id,
                              tool="refund_payment",
                              arguments={"charge_id": "ch_1", "amount_cents": 500},
                              approval_deadline=3600)
    assert record.status is CallStatus.AWAITING_APPROVAL
    return record


def _unchanged(client: DexClient, record: Any) -> None:
    """The call still waits, its interrupt is still pending, and no event was added."""
    assert client.get_tool_call(record.key).status is CallStatus.AWAITING_APPROVAL
    snapshot = client.get_agent_snapshot(SESSION)
    assert [p.interrupt_id for p in snapshot.pending_interrupts] == [record.interrupt_id]
    assert snapshot.decided == []
    assert [e.event for e in client.events(SESSION)] == ["tool_call_requested"]


def test_auth_matrix_refuses_bad_tokens_and_changes_nothing(
    http: TestClient, client: DexClient
) -> None:
    record = _refund(client)
    # The body names the session, so a token of another session is refused (with the seeds'
    # body alone it would act on its own session: test_the_seeds_body_decides_...).
    body = {"interrupt_id": record.interrupt_id, "approved": True, "session_id": SESSION}
    genuine = issue_token(SECRET, SESSION, approver="alice")
    payload, _, signature = genuine.rpartition(".")
    tampered_sig = f"{payload}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    cases: list[tuple[str, dict[str, str], int]] = [
        ("missing", {}, 401),
        ("not bearer", {"Authorization": f"Basic {genuine}"}, 401),
        ("malformed", _bearer("not-a-token"), 401),
        ("forged: other key", _bearer(issue_token("another-secret-key", SESSION)), 401),
        ("forged: tampered signature", _bearer(tampered_sig), 401),
        ("expired", _bearer(issue_token(SECRET, SESSION, ttl_seconds=60,
                                        now=time.time() - 120)), 401),
        ("other session", _bearer(issue_token(SECRET, "someone-else")), 403),
        ("no permission at all", _bearer(issue_token(SECRET, SESSION, permissions=())), 403),
    ]
    for name, headers, expected in cases:
        resolve = http.post("/interrupts/resolve", json=body, headers=headers)
        assert resolve.status_code == expected, (name, resolve.text)
        if expected == 401:
            assert resolve.headers["WWW-Authenticate"].startswith("Bearer"), name
        assert http.get(f"/sessions/{SESSION}/snapshot", headers=headers).status_code \
            == expected, name
        auth = headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
        page = http.get(f"/sessions/{SESSION}", params={"token": token})
        assert page.status_code == expected, name
        assert "text/html" in page.headers["content-type"]
        stream = http.get(f"/sessions/{SESSION}/events", params={"token": token})
        assert stream.status_code == expected, name
        _unchanged(client, record)

    # The same request with the genuine token is accepted: the refusals above were the token's.
    resolve = http.post("/interrupts/resolve", json=body, headers=_bearer(genuine))
    assert resolve.status_code == 200, resolve.text
    assert resolve.json() == {"accepted": True}


def test_query_token_is_accepted_only_where_a_browser_cannot_send_headers(
    http: TestClient, client: DexClient
) -> None:
    record = _refund(client)
    token = issue_token(SECRET, SESSION, approver="alice")
    page = http.get(f"/sessions/{SESSION}", params={"token": token})
    assert page.status_code == 200
    assert page.headers["Referrer-Policy"] == "no-referrer"
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    # The snapshot and the decision take the header only: URLs end up in logs and history.
    assert http.get(f"/sessions/{SESSION}/snapshot", params={"token": token}).status_code == 401
    resolve = http.post("/interrupts/resolve", params={"token": token},
                        json={"interrupt_id": record.interrupt_id, "approved": True})
    assert resolve.status_code == 401
    _unchanged(client, record)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        # The seeds' three texts, exactly.
        ({"approved": True}, "interrupt_id must be a non-empty string"),
        ({"interrupt_id": "", "approved": True}, "interrupt_id must be a non-empty string"),
        ({"interrupt_id": 42, "approved": True}, "interrupt_id must be a non-empty string"),
        ({"interrupt_id": None, "approved": True}, "interrupt_id must be a non-empty string"),
        ({"interrupt_id": "IID"}, "approved must be a boolean"),
        ({"interrupt_id": "IID", "approved": "yes"}, "approved must be a boolean"),
        ({"interrupt_id": "IID", "approved": 1}, "approved must be a boolean"),
        ({"interrupt_id": "IID", "approved": None}, "approved must be a boolean"),
        ({"interrupt_id": "IID", "approved": False, "rejection_message": {"text": "no"}},
         "rejection_message must be a string"),
        ({"interrupt_id": "IID", "approved": False, "rejection_message": 7},
         "rejection_message must be a string"),
        # The seeds' order: the first faulty field of the three is the one named.
        ({"approved": "yes", "rejection_message": 7}, "interrupt_id must be a non-empty string"),
        ({"interrupt_id": "IID", "approved": 0, "rejection_message": 7},
         "approved must be a boolean"),
    ],
    ids=["missing interrupt_id", "empty interrupt_id", "interrupt_id int", "interrupt_id null",
         "missing approved", "approved string", "approved int", "approved null",
         "message object", "message int", "two faults: interrupt_id first",
         "two faults: approved before message"],
)
def test_a_wrong_body_gets_400_with_the_seeds_text(
    http: TestClient, client: DexClient, body: dict[str, Any], error: str
) -> None:
    record = _refund(client)
    if body.get("interrupt_id") == "IID":
        body["interrupt_id"] = record.interrupt_id  # only the named field is wrong
    response = http.post("/interrupts/resolve", json=body,
                         headers=_bearer(issue_token(SECRET, SESSION)))
    assert response.status_code == 400, response.text
    assert response.json() == {"error": error}
    _unchanged(client, record)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"approved=true", "the body must be a JSON object; it is not valid JSON"),
        (b"", "the body must be a JSON object; it is not valid JSON"),
        (b"\xff\xfe{", "the body must be a JSON object; it is not valid JSON"),
        (b"[\"IID\", true]", "the body must be a JSON object, got a JSON array"),
        (b"\"IID\"", "the body must be a JSON object, got a JSON string"),
        (b"[" * 20000 + b"]" * 20000, "the body must be a JSON object"),
        (b'{"interrupt_id": "IID", "approved": false, "rejection_mesage": "typo"}',
         "unknown field 'rejection_mesage'"),
        (b'{"interrupt_id": "IID", "approved": true, "session_id": ""}',
         "session_id must be a non-empty string when given"),
        (b'{"interrupt_id": "IID", "approved": true, "session_id": 5}',
         "session_id must be a non-empty string when given"),
        (b'{"interrupt_id": "' + b"i" * 65 + b'", "approved": true}',
         "interrupt_id must be at most 64 characters"),
        (b'{"interrupt_id": "IID", "approved": false, "rejection_message": "' + b"m" * 4001
         + b'"}', "rejection_message must be at most 4000 characters"),
        (b'{"interrupt_id": "IID", "approved": false, "rejection_message": "a\\u0000b"}',
         "rejection_message contains a NUL character"),
        (b'{"interrupt_id": "\\ud800", "approved": true}',
         "interrupt_id contains a lone surrogate"),
    ],
    ids=["form encoded", "empty", "not utf-8", "array", "string", "nested too deep",
         "unknown field", "empty session_id", "session_id int", "interrupt_id too long",
         "message too long", "NUL in message", "lone surrogate"],
)
def test_other_bodies_the_route_cannot_use_get_400_naming_what_is_wrong(
    http: TestClient, client: DexClient, content: bytes, error: str
) -> None:
    record = _refund(client)
    content = content.replace(b"IID", record.interrupt_id.encode())
    response = http.post("/interrupts/resolve", content=content,
                         headers={**_bearer(issue_token(SECRET, SESSION)),
                                  "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    payload = response.json()
    assert list(payload) == ["error"] and payload["error"].startswith(error), payload
    _unchanged(client, record)


def test_the_seeds_body_decides_and_the_session_comes_from_the_token(
    http: TestClient, client: DexClient
) -> None:
    # Given two sessions with a call waiting each, and a token for SESSION
    record = _refund(client)
    other = _refund(client, session="other-session")
    headers = _bearer(issue_token(SECRET, SESSION, approver="carol"))
    # When the body names the other session, or the other session's interrupt
    mismatch = http.post("/interrupts/resolve", headers=headers, json={
        "interrupt_id": other.interrupt_id, "approved": True, "session_id": "other-session"})
    assert mismatch.status_code == 403, mismatch.text
    assert "another session" in mismatch.json()["detail"]
    foreign = http.post("/interrupts/resolve", headers=headers, json={
        "interrupt_id": other.interrupt_id, "approved": True})
    assert foreign.json() == {"accepted": False, "reason": "unknown_interrupt"}
    _unchanged(client, record)
    assert client.get_tool_call(other.key).status is CallStatus.AWAITING_APPROVAL
    # Then the seeds' body, rejection_message null, decides this session's call
    seeds = http.post("/interrupts/resolve", headers=headers, json={
        "interrupt_id": record.interrupt_id, "approved": False, "rejection_message": None})
    assert (seeds.status_code, seeds.json()) == (200, {"accepted": True})
    assert client.get_tool_call(record.key).status is CallStatus.REJECTED
    [decided] = client.get_agent_snapshot(SESSION).decided
    assert (decided.decision, decided.decided_by) == ("rejected", "carol")
    # And a matching session_id is accepted as well (a retry: not accepted, no error)
    again = http.post("/interrupts/resolve", headers=headers, json={
        "interrupt_id": record.interrupt_id, "approved": False, "session_id": SESSION})
    assert (again.status_code, again.json()) == (200, {"accepted": False,
                                                       "reason": "already_decided"})


def test_a_view_token_reads_the_session_but_cannot_decide(
    http: TestClient, client: DexClient
) -> None:
    record = _refund(client)
    view = issue_token(SECRET, SESSION, approver="dora", permissions=["view"])
    snapshot = http.get(f"/sessions/{SESSION}/snapshot", headers=_bearer(view))
    assert snapshot.status_code == 200
    assert [p["interrupt_id"] for p in snapshot.json()["pending_interrupts"]] \
        == [record.interrupt_id]
    assert http.get(f"/sessions/{SESSION}", params={"token": view}).status_code == 200
    # The permission is checked before the body: even a malformed body gets 403, not 400.
    for body in ({"interrupt_id": record.interrupt_id, "approved": True}, {"approved": "x"}):
        refused = http.post("/interrupts/resolve", json=body, headers=_bearer(view))
        assert refused.status_code == 403, refused.text
        assert "'operate'" in refused.json()["detail"]
    _unchanged(client, record)
    # A view token for another session reads nothing of this one.
    elsewhere = issue_token(SECRET, "other-session", permissions=["view"])
    assert http.get(f"/sessions/{SESSION}/snapshot",
                    headers=_bearer(elsewhere)).status_code == 403


def test_an_operator_token_works_on_every_session_and_lists_the_waiting_ones(
    http: TestClient, client: DexClient
) -> None:
    # Given calls waiting in two sessions (the second one newer) and one session with none
    first = _refund(client, session="sess-first")
    second = _refund(client, "c1", session="sess-second")
    _refund(client, "c2", session="sess-second")
    assert first.created_at < second.created_at
    client.call_tool(session_id="sess-quiet", turn_id="t1", tool_call_id="c1",
                     tool="lookup_order", arguments={"order_id": "1"})
    operator = _bearer(issue_token(SECRET, None, approver="olga", all_sessions=True))

    listing = http.get("/sessions", headers=operator)
    assert listing.status_code == 200, listing.text
    body = listing.json()
    assert [(s["session_id"], s["pending"]) for s in body["sessions"]] \
        == [("sess-second", 2), ("sess-first", 1)]
    assert body["truncated"] is False
    assert body["sessions"][1]["page"] == "/sessions/sess-first"
    assert body["sessions"][1]["next_deadline"] is not None
    limited = http.get("/sessions", params={"limit": 1}, headers=operator).json()
    assert [s["session_id"] for s in limited["sessions"]] == ["sess-second"]
    assert limited["truncated"] is True

    # A browser gets the page, with ?token= links to each session's page.
    token = operator["Authorization"].removeprefix("Bearer ")
    page = http.get("/sessions", params={"token": token}, headers={"Accept": "text/html"})
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert f'href="/sessions/sess-first?token={token}"' in page.text
    assert page.text.index("sess-second") < page.text.index("sess-first")
    assert "Working as <strong class=\"approver\">olga</strong>" in page.text
    # A program's request takes the header only (a URL ends up in logs).
    assert http.get("/sessions", params={"token": token}).status_code == 401

    # The operator token reads and decides any session; the body names the session.
    assert http.get("/sessions/sess-first/snapshot", headers=operator).status_code == 200
    named = http.post("/interrupts/resolve", headers=operator, json={
        "interrupt_id": first.interrupt_id, "approved": False, "session_id": "sess-first"})
    assert named.json() == {"accepted": True}
    [decided] = client.get_agent_snapshot("sess-first").decided
    assert decided.decided_by == "olga"
    unnamed = http.post("/interrupts/resolve", headers=operator, json={
        "interrupt_id": first.interrupt_id, "approved": True})
    assert unnamed.status_code == 400 and "session_id is required" in unnamed.json()["error"]

    # A session token, even an operate one, does not open the list.
    session_token = _bearer(issue_token(SECRET, "sess-first"))
    refused = http.get("/sessions", headers=session_token)
    assert refused.status_code == 403 and "--all-sessions" in refused.json()["detail"]
    assert http.get("/sessions").status_code == 401


def test_the_old_page_address_redirects_keeping_the_token(http: TestClient) -> None:
    token = issue_token(SECRET, SESSION)
    moved = http.get(f"/sessions/{SESSION}/approvals", params={"token": token},
                     follow_redirects=False)
    assert moved.status_code == 308
    assert moved.headers["location"] == f"/sessions/{SESSION}?token={token}"
    assert http.get(f"/sessions/{SESSION}/approvals", params={"token": token}).status_code \
        == 200


def test_bad_stream_cursors_and_parameters_get_400_naming_the_field(
    http: TestClient, client: DexClient
) -> None:
    record = _refund(client)
    headers = _bearer(issue_token(SECRET, SESSION))
    for params, extra, field in (
        ({"after": -1}, {}, "after"),
        ({"after": "soon"}, {}, "after"),
        ({"after": 2**63}, {}, "after"),
        ({"after": "9" * 5000}, {}, "after"),
        ({}, {"Last-Event-ID": "yesterday"}, "Last-Event-ID"),
        ({}, {"Last-Event-ID": str(2**64 + 1)}, "Last-Event-ID"),
    ):
        bad = http.get(f"/sessions/{SESSION}/events", params=params,
                       headers={**headers, **extra})
        assert bad.status_code == 400, (params, extra, bad.text)
        assert bad.json()["error"].startswith(f"{field} must be an integer from 0 to "
                                              f"{2**63 - 1}")
    too_long = http.get("/sessions/" + "s" * 201 + "/snapshot", headers=headers)
    assert too_long.status_code == 400 and "session_id" in too_long.json()["error"]
    _unchanged(client, record)


def test_approve_over_http_runs_the_call_and_a_second_decision_is_not_accepted(
    http: TestClient, client: DexClient, start_worker: StartWorker
) -> None:
    start_worker(concurrency=1)
    record = _refund(client)
    headers = _bearer(issue_token(SECRET, SESSION, approver="alice"))
    body = {"interrupt_id": record.interrupt_id, "approved": True}

    first = http.post("/interrupts/resolve", json=body, headers=headers)
    assert first.json() == {"accepted": True}
    assert client.wait(record.key, timeout=20).status is CallStatus.SUCCEEDED

    # A retry of the same decision, and a contrary one, change nothing.
    again = http.post("/interrupts/resolve", json=body, headers=headers)
    contrary = http.post("/interrupts/resolve", headers=headers,
                         json={**body, "approved": False, "rejection_message": "wait"})
    assert again.json() == {"accepted": False, "reason": "already_decided"}
    assert contrary.json() == {"accepted": False, "reason": "already_decided"}

    snapshot = http.get(f"/sessions/{SESSION}/snapshot", headers=headers).json()
    assert snapshot["pending_interrupts"] == []
    [decided] = snapshot["decided"]
    assert decided["decision"] == "approved"
    assert decided["decided_by"] == "alice"  # from the token, not from the body
    assert decided["call_status"] == "succeeded"
    [call] = snapshot["tool_calls"]
    assert call["status"] == "succeeded" and call["result"]["refunded_cents"] == 500


def test_reject_over_http_gives_the_model_the_message(
    http: TestClient, client: DexClient
) -> None:
    record = _refund(client)
    headers = _bearer(issue_token(SECRET, SESSION, approver="bob"))
    body = {"interrupt_id": record.interrupt_id, "approved": False,
            "rejection_message": "refund the customer by bank transfer instead"}
    assert http.post("/interrupts/resolve", json=body, headers=headers).json() \
        == {"accepted": True}
    final = client.get_tool_call(record.key)
    assert final.status is CallStatus.REJECTED
    assert "refund the customer by bank transfer instead" in (final.error or "")
    approve = {**body, "approved": True, "rejection_message": None}
    assert http.post("/interrupts/resolve", json=approve, headers=headers).json() \
        == {"accepted": False, "reason": "already_decided"}
    [decided] = http.get(f"/sessions/{SESSION}/snapshot", headers=headers).json()["decided"]
    assert (decided["decision"], decided["decided_by"]) == ("rejected", "bob")
    assert decided["reason"] == "refund the customer by bank transfer instead"


def test_unknown_interrupt_or_one_of_another_session_is_not_accepted(
    http: TestClient, client: DexClient
) -> None:
    # Given a pending call in another session, and a token for this one
    other = _refund(client, session="other-session")
    headers = _bearer(issue_token(SECRET, SESSION))
    for interrupt_id in ("no-such-interrupt", other.interrupt_id):
        response = http.post("/interrupts/resolve", headers=headers, json={
            "interrupt_id": interrupt_id, "approved": True})
        assert response.json() == {"accepted": False, "reason": "unknown_interrupt"}
    assert client.get_tool_call(other.key).status is CallStatus.AWAITING_APPROVAL


def test_snapshot_lists_pending_calls_with_what_a_person_needs(
    http: TestClient, client: DexClient
) -> None:
    record = _refund(client)
    response = http.get(f"/sessions/{SESSION}/snapshot",
                        headers=_bearer(issue_token(SECRET, SESSION)))
    assert response.status_code == 200
    assert float(response.headers["X-Server-Time"]) == pytest.approx(time.time(), abs=60)
    [pending] = response.json()["pending_interrupts"]
    assert pending["interrupt_id"] == record.interrupt_id
    assert pending["tool"] == "refund_payment"
    assert pending["arguments"] == {"charge_id": "ch_1", "amount_cents": 500}
    assert pending["effect"] == "non_idempotent_write"
    assert pending["deadline"] is not None


def test_openapi_documents_every_status_with_a_schema_and_health(http: TestClient) -> None:
    schema = http.get("/openapi.json").json()
    assert {"/interrupts/resolve", "/sessions", "/sessions/{session_id}",
            "/sessions/{session_id}/snapshot", "/sessions/{session_id}/events",
            "/sessions/{session_id}/approvals", "/healthz"} <= set(schema["paths"])
    resolve = schema["paths"]["/interrupts/resolve"]["post"]
    assert set(resolve["responses"]) == {"200", "400", "401", "403", "409", "413", "503"}
    for status, response in resolve["responses"].items():
        assert response["content"]["application/json"]["schema"]["$ref"], status
    assert resolve["requestBody"]["content"]["application/json"]["schema"]["$ref"] \
        == "#/components/schemas/ResolveRequest"
    components = schema["components"]["schemas"]
    body = components["ResolveRequest"]
    assert set(body["required"]) == {"interrupt_id", "approved"}
    assert set(body["properties"]) == {"interrupt_id", "approved", "rejection_message",
                                       "session_id", "arguments", "arguments_version"}
    assert body["additionalProperties"] is False
    assert components["ErrorResponse"]["required"] == ["error"]
    # Every route documents what it answers, and none documents FastAPI's unused 422.
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
    listing = schema["paths"]["/sessions"]["get"]["responses"]
    assert {"200", "400", "401", "403"} <= set(listing)
    assert set(listing["200"]["content"]) == {"application/json", "text/html"}
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    assert http.get("/docs").status_code == 200
    assert http.get("/healthz").json() == {"status": "ok", "store": "ok", "redis": "ok",
                                           "beat": "late", "event_streams": 0}
    assert http.get("/static/session.js").status_code == 200
