"""Structured logs: JSON lines with a stable action per event, and no secret in any line."""

from __future__ import annotations

import io
import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dex_tasks import CallStatus, DexClient
from dex_tasks.logs import REDACTED, configure_logging, redact
from dex_tasks.tokens import issue_token
from tests.helpers import ROOT, WorkerProcess, dex_command, free_port, wait_until

SECRET = "test-secret-key"  # what tests.conftest.fast_settings signs with


@pytest.fixture
def capture() -> Iterator[io.StringIO]:
    """Route the root logger into a buffer for one test, then put the old handlers back."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    yield stream
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])
    logging.captureWarnings(False)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_has_envelope_and_extra_fields(capture: io.StringIO) -> None:
    configure_logging("json", "INFO", stream=capture)
    logging.getLogger("dex_tasks.test").info(
        "call claimed", extra={"action": "call_claimed", "key": "s/t/c", "attempt": 2}
    )
    logging.getLogger("dex_tasks.test").debug("below the level", extra={"action": "hidden"})

    [entry] = lines(capture)
    assert entry["level"] == "INFO"
    assert entry["logger"] == "dex_tasks.test"
    assert entry["message"] == "call claimed"
    assert entry["action"] == "call_claimed"
    assert entry["key"] == "s/t/c"
    assert entry["attempt"] == 2
    assert str(entry["ts"]).endswith("Z")


def test_json_line_carries_the_exception(capture: io.StringIO) -> None:
    configure_logging("json", "INFO", stream=capture)
    try:
        raise RuntimeError("could not reach postgresql://dex:hunter2@db/dex")
    except RuntimeError:
        logging.getLogger("x").exception("store failed", extra={"action": "store_error"})

    [entry] = lines(capture)
    assert "RuntimeError" in str(entry["exc"])
    assert "hunter2" not in str(entry["exc"])


def test_secrets_are_redacted_in_messages_extras_and_by_name(capture: io.StringIO) -> None:
    configure_logging("json", "INFO", secrets=["the-signing-key-value"], stream=capture)
    log = logging.getLogger("x")
    log.info("connecting to redis://:s3cret-pw@redis:6379/0 with key the-signing-key-value",
             extra={"action": "connect", "url": "postgresql+psycopg://dex:pgpass@db:5432/dex",
                    "password": "plain", "token": "abc.def", "headers": {
                        "Authorization": "Bearer eyJhbGciOi.payload.sig"}})
    log.info('GET /sessions/s1/approvals?token=eyJzaWQi.abc&x=1 HTTP/1.1"',
             extra={"action": "http"})

    text = capture.getvalue()
    for secret in ("s3cret-pw", "the-signing-key-value", "pgpass", "plain", "abc.def",
                   "eyJhbGciOi", "eyJzaWQi"):
        assert secret not in text, secret
    first, second = lines(capture)
    assert first["message"] == f"connecting to redis://:{REDACTED}@redis:6379/0 with key {REDACTED}"
    assert first["url"] == f"postgresql+psycopg://dex:{REDACTED}@db:5432/dex"
    assert first["password"] == REDACTED
    assert second["message"] == f'GET /sessions/s1/approvals?token={REDACTED}&x=1 HTTP/1.1"'


def test_redact_leaves_ordinary_text_alone() -> None:
    text = "call s1/t1/c1 failed after 3 attempts (sqlite:///dex.db, redis://redis:6379/0)"
    assert redact(text) == text


def test_text_format_appends_extras_as_key_value(capture: io.StringIO) -> None:
    configure_logging("text", "INFO", stream=capture)
    logging.getLogger("dex_tasks.worker.sweeps").info(
        "sweep done", extra={"action": "sweep", "job": "reap expired", "count": 3,
                             "secret_key": "nope"})
    line = capture.getvalue().strip()
    assert " INFO dex_tasks.worker.sweeps sweep done " in line
    assert line.endswith(f'action=sweep job="reap expired" count=3 secret_key={REDACTED}')


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format must be one of json, text"):
        configure_logging("xml")


def test_worker_logs_json_lines_from_main_and_pool_processes(
    client: DexClient, env: dict[str, str], tmp_path: Path
) -> None:
    # Given a real worker started with --log-format json, its stderr in its own file
    out, err = tmp_path / "worker.out", tmp_path / "worker.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [*dex_command(), "worker", "--tools", "workers.example_tools", "-c", "1",
             "--log-format", "json"],
            cwd=ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True,
        )
    worker = WorkerProcess(proc, err)
    try:
        worker.wait_ready()
        # When it runs a call that succeeds and one whose tool raises
        ok = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="lookup_order", arguments={"order_id": "1001"})
        bad = client.call_tool(session_id="s1", turn_id="t2", tool_call_id="c1",
                               tool="broken_report", arguments={"report": "q3"})
        assert client.wait(ok.key, 20).status is CallStatus.SUCCEEDED
        assert client.wait(bad.key, 20).status is CallStatus.FAILED
        wait_until(lambda: "broken_report" in err.read_text(), 10, "the failure to be logged")
    finally:
        worker.stop()

    # Then every stderr line is one JSON object, pool children's lines included
    text = err.read_text()
    entries = [json.loads(line) for line in text.splitlines() if line.strip()]
    actions = {e.get("action") for e in entries}
    assert {"catalog_published", "worker_ready"} <= actions
    assert len({e["pid"] for e in entries}) >= 2, "no line from a pool child"
    assert any(e["logger"].startswith("celery") and "lookup_order" in str(e["message"])
               for e in entries), "no task line named after its tool"
    assert SECRET not in text


def test_api_access_log_redacts_approval_tokens(env: dict[str, str], tmp_path: Path) -> None:
    # Given the API logging JSON, and a person opening an approval link (token in the URL)
    port = free_port()
    err = tmp_path / "api.err"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [*dex_command(), "api", "--port", str(port), "--log-format", "json"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True,
        )
    token = issue_token(SECRET, "s1")
    try:
        import httpx

        def get() -> httpx.Response | None:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/sessions/s1",
                                 params={"token": token}, timeout=2)
            except httpx.TransportError:
                return None

        response = wait_until(get, 30, "the API to answer")
        assert response.status_code == 200
        wait_until(lambda: "/sessions/s1?token=" in err.read_text(), 10, "the access log line")
    finally:
        proc.terminate()
        proc.wait(15)

    # Then the access line is JSON and holds no token
    text = err.read_text()
    entries = [json.loads(line) for line in text.splitlines() if line.strip()]
    access = [e for e in entries if "/sessions/s1?token=" in str(e["message"])]
    assert access and f"token={REDACTED}" in str(access[0]["message"])
    assert token not in text and token.split(".")[0] not in text
    assert SECRET not in text


@pytest.mark.parametrize("key", ["s1/t\n2026-11-30 INFO forged line/c1", "s1/t\r2/c\u2028x",
                                 "s1/t=2 x/c\x1b[31m"])
def test_text_logs_keep_one_record_on_one_line(capture: io.StringIO, key: str) -> None:
    # Ids come from agents: a newline in one must not split the record or forge another.
    configure_logging("text", "INFO", stream=capture)
    logging.getLogger("dex_tasks.test").info(f"claimed {key}", extra={"action": "claimed",
                                                                      "key": key})
    output = capture.getvalue()
    assert output.endswith("\n") and output.count("\n") == 1
    assert "\r" not in output and "\u2028" not in output and "\x1b" not in output
    line = output.rstrip("\n")
    assert "action=claimed" in line
    # The value is quoted and escaped JSON: it reads back as the original id.
    assert json.loads(line.split(" key=", 1)[1]) == key
