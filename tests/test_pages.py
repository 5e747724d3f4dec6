"""The pages are Jinja2 templates on one base, autoescaped; a bad page link is answered in
HTML; the session page warns when beat is late. FastAPI's TestClient against the real app,
store and Redis."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from dex_tasks import DexSettings
from dex_tasks.api import create_api
from dex_tasks.broker.metrics import SWEEP_STATS_KEY, metrics_redis, record_sweep
from dex_tasks.tokens import issue_token

SECRET = "test-secret-key"  # tests.conftest.fast_settings
HOSTILE = '<script>alert("x")</script>&'


@pytest.fixture
def http(settings: DexSettings) -> Iterator[TestClient]:
    with TestClient(create_api(settings)) as test_client:
        yield test_client


def _head(page: str) -> str:
    return page[:page.index("<title>")] + page[page.index("</title>"):page.index("</head>")]


def test_both_pages_share_one_head_and_escape_what_a_token_or_the_store_holds(
    http: TestClient,
) -> None:
    session = 's"1<b>'
    page = http.get(f"/sessions/{session}",
                    params={"token": issue_token(SECRET, session, approver=HOSTILE)})
    assert page.status_code == 200, page.text
    operator = issue_token(SECRET, None, approver=HOSTILE, all_sessions=True)
    inbox = http.get("/sessions", params={"token": operator}, headers={"Accept": "text/html"})
    assert inbox.status_code == 200, inbox.text
    for html in (page.text, inbox.text):
        # Then the approver's name is text, never markup
        assert HOSTILE not in html and "<script>alert" not in html
        assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;&amp;" in html
    assert '<span id="session-id" class="mono">s&#34;1&lt;b&gt;</span>' in page.text
    # One base template: the same head on both pages, the session page adding its script
    assert _head(page.text).replace('\n  <script src="/static/session.js" defer></script>',
                                    "") == _head(inbox.text)
    assert page.headers["content-security-policy"].startswith("default-src 'none'")


def test_a_bad_page_link_gets_an_html_400_and_an_api_route_json(http: TestClient) -> None:
    too_long = "s" * 201
    token = issue_token(SECRET, "s1")
    for path in (f"/sessions/{too_long}", f"/sessions/{too_long}/approvals"):
        page = http.get(path, params={"token": token}, follow_redirects=False)
        assert page.status_code == 400
        assert page.headers["content-type"].startswith("text/html")
        assert "session_id" in page.text and 'class="error-page"' in page.text
    api = http.get(f"/sessions/{too_long}/snapshot", headers={"Authorization": f"Bearer {token}"})
    assert api.status_code == 400 and "session_id" in api.json()["error"]


def test_the_session_page_warns_while_no_beat_sweeps(
    http: TestClient, settings: DexSettings
) -> None:
    token = issue_token(SECRET, "s1")

    def warning_shown() -> bool:
        page = http.get("/sessions/s1", params={"token": token}).text
        tag = re.search(r'<p id="beat-late"[^>]*>', page)
        assert tag is not None, page
        shown = " hidden" not in tag.group(0)
        # The snapshot says the same, so the open page follows (static/session.js)
        snapshot = http.get("/sessions/s1/snapshot", headers={"Authorization": f"Bearer {token}"})
        assert (snapshot.json()["beat"] == "late") is shown, snapshot.text
        return shown

    # Given no beat ever swept: the page says deadlines are not enforced
    assert warning_shown()
    assert http.get("/healthz").json()["beat"] == "late"
    # When a sweep is recorded (what beat does after each), the warning goes
    record_sweep(metrics_redis(settings), "expire_deadlines", 0)
    assert not warning_shown()
    assert http.get("/healthz").json()["beat"] == "ok"
    # And it comes back when the last sweep is older than 3 sweep intervals
    redis = metrics_redis(settings)
    redis.delete(SWEEP_STATS_KEY)
    long_ago = time.time() - 4 * settings.sweep_interval_seconds
    record_sweep(redis, "expire_deadlines", 0, now=long_ago)
    assert warning_shown()
