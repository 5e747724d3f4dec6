"""Celery's own tools against real workers: ``celery -A dex_tasks events --dump``, Flower's
``/api/tasks`` and ``celery -A dex_tasks inspect``, all configured by the ``DEX_*`` environment.

What they show must be true: ``SUCCESS`` only for a call that succeeded, ``FAILURE`` (with the
dex error) for one that failed or ended ``outcome_unknown``, ``RETRY`` and a ``task-retried``
event per retry, ``IGNORED`` for a duplicate delivery; each task named after its tool, with the
idempotency key as its only argument and never the call's arguments; no sweep in the lists.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dex_tasks import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, DexClient
from dex_tasks.broker.celery_app import publish
from dex_tasks.errors import CallOutcomeUnknown
from tests.conftest import StartWorker
from tests.helpers import ROOT, free_port, start_process, started_pid, wait_until

TOOLS = "workers.example_tools,tests.runtime_tools,tests.edge_tools"
# Argument values no monitor may ever show: arguments may be private.
SECRETS = ("PRIVATE-ORDER-7731", "1 Secret Lane", "31337")

# One event line of `celery events --dump`: "<host> [<time>] task <type>: <name>(<uuid>) ..."
EVENT = re.compile(r"^(?P<host>\S+) \[[^\]]+\] task (?P<type>[a-z]+):? (?P<name>[^\s(]*)"
                   r"\((?P<uuid>[0-9a-f-]{36})\) args=(?P<args>\S+) kwargs=(?P<kwargs>\S*)"
                   r"(?P<rest>.*)$")


def _celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "dex_tasks", *args]


@dataclass
class Event:
    """One task event as `celery events --dump` printed it."""

    type: str
    name: str
    uuid: str
    key: str
    rest: str
    lines: list[str] = field(default_factory=list)


def _dumped_events(text: str) -> list[Event]:
    events: list[Event] = []
    for line in text.splitlines():
        match = EVENT.match(line)
        if match is None:
            if events:  # a traceback's continuation lines belong to the event before
                events[-1].lines.append(line)
            continue
        args = ast.literal_eval(match["args"])
        events.append(Event(match["type"], match["name"], match["uuid"], str(args[0]),
                            match["rest"]))
    return events


def _flower_get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return json.loads(response.read())


def _flower_tasks(port: int) -> dict[str, dict[str, Any]]:
    """Flower's tasks (one per message) by idempotency key, the task's only argument; a second
    message for the same key is listed as ``key#2``, and so on, in the order they were sent."""
    messages: dict[str, list[dict[str, Any]]] = {}
    for task in _flower_get(port, "/api/tasks").values():
        key = str(ast.literal_eval(task["args"])[0]) if task.get("args") else "?"
        messages.setdefault(key, []).append(task)
    by_key: dict[str, dict[str, Any]] = {}
    for key, tasks in messages.items():
        tasks.sort(key=lambda t: t.get("sent") or t.get("received") or 0)
        for n, task in enumerate(tasks, start=1):
            by_key[key if n == 1 else f"{key}#{n}"] = task
    return by_key


@pytest.fixture
def monitors(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """`celery -A dex_tasks events --dump` (its output file) and Flower (its port)."""
    dump_path = tmp_path / "events.log"
    port = free_port()
    with open(dump_path, "wb") as dump_out, open(tmp_path / "flower.log", "wb") as flower_out:
        dump = subprocess.Popen(_celery("events", "--dump"), cwd=ROOT, env=env,
                                stdout=dump_out, stderr=subprocess.STDOUT)
        flower = subprocess.Popen(
            _celery("flower", f"--port={port}", "--address=127.0.0.1"), cwd=ROOT,
            env={**env, "FLOWER_UNAUTHENTICATED_API": "true"},
            stdout=flower_out, stderr=subprocess.STDOUT)
    try:
        yield dump_path, port
    finally:
        for proc in (dump, flower):
            proc.kill()
            proc.wait(10)


def _call(client: DexClient, call_id: str, tool: str, **arguments: Any) -> str:
    return client.call_tool(session_id="s-monitor", turn_id="t1", tool_call_id=call_id,
                            tool=tool, arguments=arguments).key


def test_events_and_flower_show_the_true_state_of_each_call(
    client: DexClient, start_worker: StartWorker, monitors: tuple[Path, int],
    env: dict[str, str], tmp_path: Path,
) -> None:
    dump_path, port = monitors
    # Given a worker, beat sending sweeps every half second, and both monitors listening
    worker = start_worker(concurrency=2, tools=TOOLS, events=True)
    beat = start_process(["beat"], env, tmp_path / "beat.log")
    try:
        node = wait_until(lambda: re.search(r"^(dex-\d+@\S+) \[.*\] heartbeat",
                                            dump_path.read_text(), re.M), 30,
                          "the event dump to see the worker's heartbeat")[1]
        wait_until(lambda: _flower_alive(port, node), 30, "Flower to see the worker")

        # When calls succeed, fail, retry, end outcome_unknown, and one is delivered twice
        ok = _call(client, "ok", "update_address", order_id="1001", address=SECRETS[1])
        failed = _call(client, "failed", "broken_report", report="q3")
        retried = _call(client, "retried", "flaky_lookup", order_id=SECRETS[0], fail_times=2)
        gave_up = _call(client, "gave-up", "flaky_lookup", order_id="1002", fail_times=99)
        unknown = _call(client, "unknown", "unsure_charge", amount_cents=int(SECRETS[2]))
        hinted = _call(client, "hinted", "hinted_lookup", retry_after="inf")
        outcomes = {k: client.wait(k, timeout=30).status
                    for k in (ok, failed, retried, gave_up, unknown, hinted)}
        assert outcomes == {ok: CallStatus.SUCCEEDED, failed: CallStatus.FAILED,
                            retried: CallStatus.SUCCEEDED, gave_up: CallStatus.FAILED,
                            unknown: CallStatus.OUTCOME_UNKNOWN, hinted: CallStatus.SUCCEEDED}
        # And a late duplicate of the succeeded call arrives
        row = client.store.get_call(ok)
        assert row is not None
        publish(client.app, row)

        def settled() -> dict[str, dict[str, Any]] | None:
            tasks = _flower_tasks(port)
            done = all(tasks.get(k, {}).get("state") in ("SUCCESS", "FAILURE")
                       for k in (ok, failed, retried, gave_up, unknown, hinted))
            return tasks if done and tasks.get(f"{ok}#2", {}).get("state") == "IGNORED" \
                else None

        # Then Flower shows each call's true state
        tasks = wait_until(settled, 30, "Flower to see every call end")
    finally:
        beat.kill()
        beat.wait(10)
    calls = (ok, failed, retried, gave_up, unknown, hinted)
    assert {k: tasks[k]["state"] for k in calls} == {
        ok: "SUCCESS", failed: "FAILURE", retried: "SUCCESS", gave_up: "FAILURE",
        unknown: "FAILURE", hinted: "SUCCESS"}
    assert tasks[f"{ok}#2"]["state"] == "IGNORED"
    assert tasks[failed]["exception"] == "CallFailed(\"ValueError: report 'q3' does not exist\")"
    assert tasks[unknown]["exception"].startswith(
        f'CallOutcomeUnknown("{OUTCOME_UNKNOWN_TOOL_RESULT}')
    assert tasks[gave_up]["exception"].startswith("CallFailed('the tool failed on all 4 attempts")
    # (A retry is RETRY in Flower until the worker takes the retry's message, which it does at
    # once to hold it until its countdown ends; Flower keeps the retries' count and time.)
    for key, count in ((retried, 2), (gave_up, 3), (hinted, 1)):
        assert tasks[key]["retries"] == count and tasks[key]["retried"] is not None
    for key, task in tasks.items():
        tool = client.get_tool_call(key.split("#")[0]).tool
        assert task["name"].endswith(f"[{tool}]"), task
        assert task["kwargs"] == "{}"
        assert not task.get("result") or task["result"] == "None"
    # Nothing but the calls: no sweep, although beat sent them all along
    assert set(tasks) == {*calls, f"{ok}#2"}

    # And the event dump tells the same story, message by message
    dump = dump_path.read_text()
    assert "dex.sweep" not in dump
    events = _dumped_events(dump)
    by_key: dict[str, list[str]] = {}
    for event in events:
        assert event.name.startswith("dex.call"), event
        by_key.setdefault(event.key, []).append(event.type)
    finals = {k: [t for t in types if t in ("succeeded", "failed", "retried", "ignored")]
              for k, types in by_key.items()}
    assert finals == {ok: ["succeeded", "ignored"], failed: ["failed"],
                      retried: ["retried", "retried", "succeeded"],
                      gave_up: ["retried", "retried", "retried", "failed"],
                      unknown: ["failed"], hinted: ["retried", "succeeded"]}
    failure = next(e for e in events if e.key == unknown and e.type == "failed")
    assert f"exception=CallOutcomeUnknown(\"{OUTCOME_UNKNOWN_TOOL_RESULT}" in failure.rest
    # Each task-retried event matches one transient error the store counted, within the cap
    for key, retries in ((retried, 2), (gave_up, 3), (hinted, 1)):
        waits = [json.loads(e.detail or "{}") for e in client.store.events_for_call(key)
                 if e.from_status == "running" and e.to_status == "queued"]
        assert len(waits) == retries
        assert all(w["reason"] == "transient_error" for w in waits)
        assert all(0 <= w["retry_in"] <= client.settings.retry_backoff_max_seconds for w in waits)
    assert client.get_tool_call(retried).attempts == 3
    assert client.get_tool_call(gave_up).attempts == 4
    # And no monitor ever saw an argument
    flower_json = json.dumps(_flower_get(port, "/api/tasks"))
    for secret in SECRETS:
        assert secret not in dump and secret not in flower_json
    # And dex-tasks logged no traceback for the calls that failed: they are expected failures
    log = worker.log()
    assert "Traceback" not in log, log[-3000:]
    assert "raised expected: CallFailed(\"ValueError: report 'q3' does not exist\")" in log


def test_flower_shows_the_outcome_unknown_error_for_a_child_killed_mid_call(
    client: DexClient, start_worker: StartWorker, monitors: tuple[Path, int],
    ledger_path: Path,
) -> None:
    dump_path, port = monitors
    # Given a worker sending task events, and Flower following it
    worker = start_worker(concurrency=1, events=True)
    node = wait_until(lambda: re.search(r"^(dex-\d+@\S+) \[.*\] heartbeat",
                                        dump_path.read_text(), re.M), 30,
                      "the event dump to see the worker's heartbeat")[1]
    wait_until(lambda: _flower_alive(port, node), 30, "Flower to see the worker")
    # When the child running a single-attempt charge is SIGKILLed mid-call
    key = _call(client, "killed", "charge_card", customer_id="cu_1", amount_cents=5, sleep=60)
    os.kill(started_pid(ledger_path, key), signal.SIGKILL)
    record = client.wait(key, timeout=30)
    assert record.status is CallStatus.OUTCOME_UNKNOWN
    # Then Flower shows the call's own outcome-unknown error, not Celery's wrapper
    task = wait_until(lambda: (t := _flower_tasks(port).get(key)) and t.get("state") == "FAILURE"
                      and t, 30, "Flower to see the killed call fail")
    assert task["exception"] == repr(CallOutcomeUnknown(record.error or "")), task["exception"]
    assert "ExceptionWithTraceback" not in task["exception"]
    assert "the worker process running the tool was lost" in task["exception"]
    # And so does the event dump
    failed = wait_until(lambda: next((e for e in _dumped_events(dump_path.read_text())
                                      if e.key == key and e.type == "failed"), None), 30,
                        "the event dump to see the killed call fail")
    assert "exception=CallOutcomeUnknown(" in failed.rest, failed.rest
    assert worker.proc.poll() is None  # the worker itself lives on


def _flower_alive(port: int, node: str) -> bool:
    try:
        return bool(_flower_get(port, "/api/workers?status=true").get(node))
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def test_task_events_are_off_unless_asked_for(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], tmp_path: Path,
) -> None:
    # Given `celery events --dump` listening and a worker started without -E
    dump_path = tmp_path / "events.log"
    with open(dump_path, "wb") as out:
        dump = subprocess.Popen(_celery("events", "--dump"), cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        quiet = start_worker(concurrency=1)
        # When a call runs to the end on it
        key = _call(client, "quiet", "lookup_order", order_id="1001")
        assert client.wait(key, timeout=30).status is CallStatus.SUCCEEDED
        quiet.discard()
        # Then a worker started with -E is seen by the dump (so it was listening) ...
        loud = start_worker(concurrency=1, events=True)
        wait_until(lambda: re.search(rf"dex-{loud.pid}@\S+ \[.*\] heartbeat",
                                     dump_path.read_text()), 30, "the -E worker's heartbeat")
        # ... and the first worker sent no task event and no heartbeat (Celery still
        # announces a worker coming online, whatever -E says)
        text = dump_path.read_text()
        assert not re.search(rf"dex-{quiet.pid}@\S+ \[.*\] heartbeat", text), text[-2000:]
        assert not re.search(r"\] task ", text), text[-2000:]
    finally:
        dump.kill()
        dump.wait(10)


def test_celery_inspect_answers_with_the_dex_settings(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path
) -> None:
    worker = start_worker(concurrency=1)
    node = wait_until(lambda: re.search(rf"(dex-{worker.pid}@\S+) ready\.", worker.log()), 10,
                      "the worker's node name")[1]
    running = _call(client, "slow", "lookup_order", order_id=SECRETS[0], sleep=60)
    started_pid(ledger_path, running)
    # `celery -A dex_tasks` finds the module-level app, configured from DEX_* alone. (Naming the
    # node lets inspect return on its reply instead of waiting out its timeout.)
    replies = {}
    for command in ("ping", "stats", "active"):
        out = subprocess.run(_celery("inspect", command, "--json", "-d", node, "--timeout", "30"),
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        replies[command] = json.loads(out.stdout)[node]
    assert replies["ping"] == {"ok": "pong"}
    assert replies["stats"]["pool"]["max-concurrency"] == 1
    broker_port = int(env["DEX_REDIS_URL"].rsplit(":", 1)[1].split("/")[0])
    assert replies["stats"]["broker"]["port"] == broker_port
    [active] = replies["active"]
    assert active["name"] == "dex.call_tool[lookup_order]"
    assert active["args"] == [running] and active["kwargs"] == {}
    assert SECRETS[0] not in json.dumps(replies)


def test_importing_the_module_level_app_connects_to_nothing(env: dict[str, str]) -> None:
    # Given a broker URL where nothing listens: an import that connected would hang or fail
    dead = {**env, "DEX_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", "from dex_tasks.celery import app; "
         "print(app.conf.broker_url, app.conf.accept_content)"],
        cwd=ROOT, env=dead, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == dead["DEX_REDIS_URL"]
    assert "['json']" in out.stdout
    assert time.monotonic() - started < 20
