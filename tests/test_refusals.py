"""Why a decision was refused (``resolve_interrupt`` stays a bool; ``why_not_resolved`` and the
HTTP route's ``reason`` say why), and one JSON error shape on every HTTP status."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

import workers.example_tools  # noqa: F401 - registers refund_payment in this process
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.agent.approvals import refusal_reason
from dex_tasks.api import create_api
from dex_tasks.tokens import issue_token
from tests.conftest import fast_settings

SECRET = "test-secret-key"  # tests.conftest.fast_settings


@pytest.fixture
def db_client(redis_url: str, database_url: str) -> Iterator[DexClient]:
    with DexClient(fast_settings(redis_url, database_url)) as c:
        yield c


def _refund(client: DexClient, session: str, call_id: str) -> tuple[str, str]:
    record = client.call_tool(session_id=session, turn_id="t1", tool_call_id=call_id,
                              tool="refund_payment",
                              arguments={"charge_id": "ch_1", "amount_cents": 500},
                              approval_deadline=3600)
    assert record.status is CallStatus.AWAITING_APPROVAL and record.interrupt_id
    return record.key, record.interrupt_id


def test_why_not_resolved_names_each_reason_and_changes_nothing(db_client: DexClient) -> None:
    # Given a waiting refund in s1
    key, interrupt = _refund(db_client, "s1", "c1")
    # Then it can be decided, and asking says so without deciding it
    assert db_client.why_not_resolved("s1", interrupt) is None
    assert db_client.get_tool_call(key).status is CallStatus.AWAITING_APPROVAL
    assert db_client.why_not_resolved("s1", "no-such-interrupt") == "unknown_interrupt"
    assert not db_client.resolve_interrupt("s2", interrupt, True)
    assert db_client.why_not_resolved("s2", interrupt) == "wrong_session"
    # Past its deadline (the sweep has not run): deadline_passed
    assert refusal_reason(db_client.store, "s1", interrupt,
                          now=time.time() + 7200) == "deadline_passed"
    # When it is decided, a second decision is refused as already decided
    assert db_client.resolve_interrupt("s1", interrupt, False, approver="alice")
    assert not db_client.resolve_interrupt("s1", interrupt, True, approver="bob")
    assert db_client.why_not_resolved("s1", interrupt) == "already_decided"
    assert db_client.get_tool_call(key).status is CallStatus.REJECTED


@pytest.fixture
def http(redis_url: str, sqlite_url: str) -> Iterator[tuple[TestClient, DexClient]]:
    settings: DexSettings = fast_settings(redis_url, sqlite_url)
    with TestClient(create_api(settings)) as test_client, DexClient(settings) as client:
        yield test_client, client


def test_every_error_status_answers_json_with_an_error_text(
        http: tuple[TestClient, DexClient]) -> None:
    api, client = http
    _, interrupt = _refund(client, "s1", "c1")
    good = {"Authorization": f"Bearer {issue_token(SECRET, 's1', approver='alice')}"}
    view = {"Authorization": f"Bearer {issue_token(SECRET, 's1', permissions=('view',))}"}
    answers = {
        400: api.get("/sessions/s1/events", params={"after": "x"}, headers=good),
        401: api.get("/sessions/s1/snapshot"),
        403: api.post("/interrupts/resolve", headers=view,
                      json={"interrupt_id": interrupt, "approved": True}),
        404: api.get("/no/such/route"),
        405: api.delete("/sessions/s1/snapshot", headers=good),
        413: api.post("/interrupts/resolve", headers=good, content=b"x" * 70_000),
    }
    for status, answer in answers.items():
        assert answer.status_code == status, (status, answer.text)
        body = answer.json()
        assert isinstance(body.get("error"), str) and body["error"], (status, body)
    assert answers[401].headers["WWW-Authenticate"].startswith("Bearer")


def test_the_route_says_why_a_decision_was_not_accepted(
        http: tuple[TestClient, DexClient]) -> None:
    api, client = http
    _, interrupt = _refund(client, "s1", "c1")
    _, foreign = _refund(client, "s2", "c1")
    headers = {"Authorization": f"Bearer {issue_token(SECRET, 's1', approver='alice')}"}

    def resolve(interrupt_id: str) -> object:
        return api.post("/interrupts/resolve", headers=headers,
                        json={"interrupt_id": interrupt_id, "approved": True}).json()

    assert resolve(interrupt) == {"accepted": True}
    assert resolve(interrupt) == {"accepted": False, "reason": "already_decided"}
    # Another session's interrupt is not this token's to learn about: unknown, like a made-up id
    assert resolve(foreign) == {"accepted": False, "reason": "unknown_interrupt"}
    assert resolve("made-up") == {"accepted": False, "reason": "unknown_interrupt"}
