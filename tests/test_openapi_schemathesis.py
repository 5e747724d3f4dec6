"""The API answers as its OpenAPI document says: schemathesis generates requests from
``/openapi.json`` (ones that fit the schema and ones that break it), sends them in process to
the real app over a real store and Redis, and fails on a server error, an undocumented status
or content type, or a body or header that does not match its schema. A bounded number of cases
per operation keeps it to seconds.

Requests carry a genuine operator token (deciding and reading any session), so the routes are
exercised past their token checks; the event streams are told the server is closing, so each
stream answers and ends at once instead of running forever.

(Schemathesis's own pytest loader does not run on pytest 9 yet: the cases are drawn here with
Hypothesis from each operation's strategy.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import workers.example_tools  # noqa: F401 - refund_payment registered: resolve reaches the store
from dex_tasks import DexSettings
from dex_tasks.api import create_api
from dex_tasks.tokens import issue_token

SECRET = "test-secret-key"  # tests.conftest.fast_settings
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance]
CASES_PER_OPERATION = 20  # in each mode


@pytest.fixture
def api_schema(settings: DexSettings) -> Iterator[schemathesis.BaseSchema]:
    api = create_api(settings)
    with TestClient(api):  # runs the lifespan: the app's client is closed after
        api.state.dex.streams.closing = True
        yield schemathesis.openapi.from_asgi("/openapi.json", api)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_matches_the_openapi_document(
    api_schema: schemathesis.BaseSchema, mode: GenerationMode
) -> None:
    token = issue_token(SECRET, None, approver="schemathesis", all_sessions=True)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        def answers_as_documented(case: schemathesis.Case) -> None:
            sent = case.headers or {}
            auth = {} if "Authorization" in sent else {"Authorization": f"Bearer {token}"}
            case.call_and_validate(headers=auth, checks=CHECKS)

        try:
            answers_as_documented()
        except Unsatisfiable:
            # Nothing to break in a route without parameters or body (/healthz, /metrics).
            assert mode is GenerationMode.NEGATIVE, operation.label


def test_cursors_are_integers_and_page_links_answer_html_in_the_document(
    settings: DexSettings,
) -> None:
    with TestClient(create_api(settings)) as http:
        paths = http.get("/openapi.json").json()["paths"]
    params = {p["name"]: p["schema"] for p in paths["/sessions/{session_id}/events"]["get"]
              ["parameters"]}
    for name in ("after", "Last-Event-ID"):
        integer = next(s for s in params[name]["anyOf"] if s["type"] != "null")
        assert integer == {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}, params[name]
    for page in ("/sessions/{session_id}", "/sessions/{session_id}/approvals"):
        assert list(paths[page]["get"]["responses"]["400"]["content"]) == ["text/html"], page
