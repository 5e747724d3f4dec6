"""uvicorn's access log never shows a ``?token=`` value, however the API is started: here as
``app.py`` documents it, ``uvicorn --factory dex_tasks.api.app:from_env``, with uvicorn's own
log configuration and formatters (issue 19, finding 14)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from dex_tasks.tokens import issue_token
from tests.helpers import ROOT, free_port, wait_until


def test_uvicorn_factory_access_log_redacts_page_tokens(env: dict[str, str],
                                                         tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "uvicorn.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "dex_tasks.api.app:from_env",
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 30, "uvicorn to serve the API")
        token = issue_token("test-secret-key", "sess-log", permissions=["view"])
        # A good link, a bad one, and the token second in the query: none may be logged.
        assert httpx.get(f"{url}/sessions/sess-log?token={token}").status_code == 200
        assert httpx.get(f"{url}/sessions/sess-log?token=not-a-real-token-value").status_code \
            == 401
        httpx.get(f"{url}/sessions/sess-log/approvals?x=1&token={token}")
        wait_until(lambda: log_path.read_text().count("token=***") >= 3, 10,
                   "three access log lines")
    finally:
        proc.terminate()
        proc.wait(10)
    text = log_path.read_text()
    assert token not in text and "not-a-real-token-value" not in text, text
    # The access lines are still there, formatted by uvicorn, with the path and status.
    assert '"GET /sessions/sess-log?token=*** HTTP/1.1" 200' in text, text
