"""Health: ``dex-tasks status`` and the compose healthchecks follow a real worker and beat,
``/healthz`` checks the store and Redis, and the shipped dashboard and alert rules name only
metrics ``/metrics`` serves."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import redis
import yaml
from fastapi.testclient import TestClient

from dex_tasks import DexClient, DexSettings
from dex_tasks.api import create_api
from dex_tasks.broker.metrics import beat_is_late, last_sweep_at, record_sweep, render_metrics
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import run_job
from tests.conftest import StartWorker, fast_settings
from tests.helpers import ROOT, dex_command, free_port, start_process, wait_until

DEPLOY = ROOT / "deploy"


def status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*dex_command(), "status", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_status_and_the_healthchecks_follow_a_real_worker_and_beat(
        env: dict[str, str], settings: DexSettings, start_worker: StartWorker,
        tmp_path: Path) -> None:
    sweeps = redis.Redis.from_url(settings.redis_url)

    def beat_late() -> bool:
        return beat_is_late(last_sweep_at(sweeps), settings.sweep_interval_seconds)

    # Given a worker and no beat (sweep interval 0.5 s: late after 1.5 s)
    start_worker()
    # Then the worker's healthcheck passes and beat's fails, saying what to do
    assert status(env, "--check", "worker").returncode == 0
    late = status(env, "--check", "beat")
    assert late.returncode == 1 and "beat     LATE" in late.stderr
    assert "start `dex-tasks beat`" in late.stderr and "Traceback" not in late.stderr
    # When a beat runs, its healthcheck passes and the full status is all ok
    beat = start_process(["beat"], env, tmp_path / "beat.log")
    try:
        wait_until(lambda: not beat_late(), 60, "beat's first sweep")
        full = status(env)
        assert full.returncode == 0, full.stderr
        assert re.search(r"^store    ok", full.stdout, re.M)
        assert re.search(r"^worker   \S+ \(prefork x2, \d+ tools\)", full.stdout, re.M)
        assert "beat     ok  last sweep" in full.stdout
    finally:
        beat.kill()
        beat.wait(10)
    # When beat is gone, its healthcheck fails again once 3 intervals pass
    wait_until(beat_late, 30, "3 sweep intervals without a sweep")
    assert status(env, "--check", "beat").returncode == 1


def test_healthz_checks_redis_and_says_whether_beat_sweeps(
        redis_url: str, sqlite_url: str, client: DexClient, rt: Runtime) -> None:
    settings = fast_settings(redis_url, sqlite_url)
    with TestClient(create_api(settings)) as http:
        assert http.get("/healthz").json()["beat"] == "late"
        record_sweep(rt.redis, "expire_approvals", 0)
        ok = http.get("/healthz")
        assert ok.status_code == 200
        assert ok.json() == {"status": "ok", "store": "ok", "redis": "ok", "beat": "ok",
                             "event_streams": 0}
    # Given an API whose Redis does not answer
    dead: DexSettings = fast_settings(f"redis://127.0.0.1:{free_port()}/0", sqlite_url)
    with TestClient(create_api(dead)) as http:
        down = http.get("/healthz")
    assert down.status_code == 503
    assert down.json()["redis"] == "unreachable" and down.json()["error"]


def _served_metric_names(client: DexClient, rt: Runtime) -> set[str]:
    # Every family appears: a sweep ran, a call ended (the histogram), an approval waits.
    client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1", tool="refund_payment",
                     arguments={"charge_id": "ch_1", "amount_cents": 100}, approval_deadline=0.01)
    run_job(rt, "expire_approvals")
    client.call_tool(session_id="s1", turn_id="t2", tool_call_id="c1", tool="refund_payment",
                     arguments={"charge_id": "ch_1", "amount_cents": 100})
    text = render_metrics(client.store, rt.redis)[0].decode()
    names = set()
    for family in re.findall(r"^# TYPE (\w+) ", text, re.M):
        names |= {family, *(family + s for s in ("_total", "_bucket", "_sum", "_count"))}
    return names


def test_the_dashboard_and_alert_rules_name_only_metrics_that_are_served(
        client: DexClient, rt: Runtime, tmp_path: Path) -> None:
    import workers.example_tools  # noqa: F401 - registers refund_payment in this process

    served = _served_metric_names(client, rt)
    dashboard = json.loads((DEPLOY / "grafana" / "dex-tasks.json").read_text())
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    named = {m for e in exprs for m in re.findall(r"\bdex_\w+", e)}
    assert named - served == set()
    # What the issue asks to see, each on the dashboard
    for needed in ("dex_tool_calls_ended_total", "dex_tool_calls_open", "dex_pending_approvals",
                   "dex_oldest_pending_approval_age_seconds", "dex_beat_last_sweep_age_seconds",
                   "dex_workers_alive"):
        assert any(needed in e for e in exprs[:len(dashboard["panels"])]), needed
    # The sweep label is "sweep": a "job" label would be renamed exported_job by the scrape
    text = render_metrics(client.store, rt.redis)[0].decode()
    assert re.search(r'^dex_sweep_runs_total\{sweep="expire_approvals"\} ', text, re.M)
    assert 'job="' not in text
    promtool = shutil.which("promtool")
    if promtool:  # Debian's prometheus package; the YAML checks above run everywhere
        checked = subprocess.run([promtool, "check", "rules",
                                  str(DEPLOY / "prometheus" / "alerts.yml")],
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr
