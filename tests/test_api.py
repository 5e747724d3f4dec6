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
    body = {"session_id": SESSION, "interrupt_id": record.interrupt_id, "approved": True}
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
        ("no operate permission", _bearer(issue_token(SECRET, SESSION, permissions=())), 403),
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
        page = http.get(f"/sessions/{SESSION}/approvals", params={"token": token})
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
    page = http.get(f"/sessions/{SESSION}/approvals", params={"token": token})
    assert page.status_code == 200
    assert page.headers["Referrer-Policy"] == "no-referrer"
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    # The snapshot and the decision take the header only: URLs end up in logs and history.
    assert http.get(f"/sessions/{SESSION}/snapshot", params={"token": token}).status_code == 401
    resolve = http.post("/interrupts/resolve", params={"token": token},
                        json={"session_id": SESSION, "interrupt_id": record.interrupt_id,
                              "approved": True})
    assert resolve.status_code == 401
    _unchanged(client, record)


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({"session_id": SESSION, "approved": True}, ["interrupt_id"]),
        ({"session_id": SESSION, "interrupt_id": "IID"}, ["approved"]),
        ({"session_id": SESSION, "interrupt_id": "IID", "approved": "yes"}, ["approved"]),
        ({"session_id": SESSION, "interrupt_id": "IID", "approved": 1}, ["approved"]),
        ({"session_id": SESSION, "interrupt_id": 42, "approved": True}, ["interrupt_id"]),
        ({"session_id": SESSION, "interrupt_id": "IID", "approved": False,
          "rejection_message": {"text": "no"}}, ["rejection_message"]),
        ({"session_id": SESSION, "interrupt_id": "IID", "approved": False,
          "rejection_mesage": "typo"}, ["rejection_mesage"]),
        ({"decision": {"session_id": SESSION, "interrupt_id": "IID", "approved": True}},
         ["session_id", "interrupt_id", "approved", "decision"]),
        ({"session_id": [SESSION], "interrupt_id": "IID", "approved": True}, ["session_id"]),
        ([SESSION, "IID", True], ["body"]),
    ],
    ids=["missing interrupt_id", "missing approved", "approved string", "approved int",
         "interrupt_id int", "message object", "unknown field", "extra nesting",
         "session_id list", "array body"],
)
def test_malformed_body_gets_422_naming_the_field(
    http: TestClient, client: DexClient, body: Any, fields: list[str]
) -> None:
    record = _refund(client)
    if isinstance(body, dict) and body.get("interrupt_id") == "IID":
        body["interrupt_id"] = record.interrupt_id  # only the named field is wrong
    response = http.post("/interrupts/resolve", json=body,
                         headers=_bearer(issue_token(SECRET, SESSION)))
    assert response.status_code == 422, response.text
    payload = response.json()
    for field in fields:
        assert field in payload["message"], (field, payload)
    located = {str(part) for item in payload["detail"] for part in item["loc"]}
    assert set(fields) <= located | {"body"}
    # The submitted values are not echoed back.
    assert all("input" not in item for item in payload["detail"])
    _unchanged(client, record)


def test_body_that_is_not_json_and_bad_stream_cursors_get_422(
    http: TestClient, client: DexClient
) -> None:
    record = _refund(client)
    headers = _bearer(issue_token(SECRET, SESSION))
    response = http.post("/interrupts/resolve", content=b"approved=true",
                         headers={**headers, "Content-Type": "application/json"})
    assert response.status_code == 422
    assert "body" in response.json()["message"]
    bad_after = http.get(f"/sessions/{SESSION}/events", params={"after": -1}, headers=headers)
    assert bad_after.status_code == 422 and "after" in bad_after.json()["message"]
    bad_last = http.get(f"/sessions/{SESSION}/events",
                        headers={**headers, "Last-Event-ID": "yesterday"})
    assert bad_last.status_code == 422 and "Last-Event-ID" in bad_last.json()["message"]
    _unchanged(client, record)


def test_approve_over_http_runs_the_call_and_a_second_decision_is_not_accepted(
    http: TestClient, client: DexClient, start_worker: StartWorker
) -> None:
    start_worker(concurrency=1)
    record = _refund(client)
    headers = _bearer(issue_token(SECRET, SESSION, approver="alice"))
    body = {"session_id": SESSION, "interrupt_id": record.interrupt_id, "approved": True}

    first = http.post("/interrupts/resolve", json=body, headers=headers)
    assert first.json() == {"accepted": True}
    assert client.wait(record.key, timeout=20).status is CallStatus.SUCCEEDED

    # A retry of the same decision, and a contrary one, change nothing.
    again = http.post("/interrupts/resolve", json=body, headers=headers)
    contrary = http.post("/interrupts/resolve", headers=headers,
                         json={**body, "approved": False, "rejection_message": "wait"})
    assert again.json() == {"accepted": False}
    assert contrary.json() == {"accepted": False}

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
    body = {"session_id": SESSION, "interrupt_id": record.interrupt_id, "approved": False,
            "rejection_message": "refund the customer by bank transfer instead"}
    assert http.post("/interrupts/resolve", json=body, headers=headers).json() \
        == {"accepted": True}
    final = client.get_tool_call(record.key)
    assert final.status is CallStatus.REJECTED
    assert "refund the customer by bank transfer instead" in (final.error or "")
    approve = {**body, "approved": True, "rejection_message": None}
    assert http.post("/interrupts/resolve", json=approve, headers=headers).json() \
        == {"accepted": False}
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
            "session_id": SESSION, "interrupt_id": interrupt_id, "approved": True})
        assert response.json() == {"accepted": False}
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


def test_openapi_docs_and_health(http: TestClient) -> None:
    schema = http.get("/openapi.json").json()
    assert {"/interrupts/resolve", "/sessions/{session_id}/snapshot",
            "/sessions/{session_id}/events", "/sessions/{session_id}/approvals",
            "/healthz"} <= set(schema["paths"])
    resolve_schema = schema["components"]["schemas"]["ResolveRequest"]
    assert set(resolve_schema["required"]) == {"session_id", "interrupt_id", "approved"}
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    assert http.get("/docs").status_code == 200
    assert http.get("/healthz").json() == {"status": "ok", "store": "ok", "event_streams": 0}
    assert http.get("/static/approvals.js").status_code == 200
