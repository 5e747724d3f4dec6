"""``dex-tasks dev --tools MODULE``: the README's Quick start as pasted, a tools module edited
while it runs (the new tool published; a syntax error one line, then fixed), and Ctrl-C leaving
no process behind. Its processes are found as the demo's are (tests/test_demo.py): by a marker
in the environment every descendant inherits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dex_tasks import DexClient, DexSettings
from tests.helpers import ROOT, dex_command, wait_until
from tests.test_demo import demo_env, marked_pids
from tests.test_docs import parse_page

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="finds leftover processes through /proc")

NEW_TOOL = '''

@tool(effect="read")
def ping(ctx: ToolContext) -> str:
    return "pong"
'''


@pytest.fixture
def marker() -> Iterator[str]:
    value = uuid.uuid4().hex
    yield value
    for pid in marked_pids(value):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def quick_start(tmp_path: Path) -> tuple[dict[str, str], list[str], list[list[str]]]:
    """The README's Quick start: its files, its agent's python blocks, its commands."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    page = tmp_path / "quick-start.md"
    page.write_text(section)
    parsed = parse_page(page)
    return parsed.files, parsed.scripts, parsed.shell


@pytest.mark.timeout(480)  # four worker starts and a run of the agent, on a loaded machine
def test_the_quick_start_runs_on_dev_which_reloads_and_stops_clean(
        marker: str, tmp_path: Path) -> None:
    # Given the Quick start's my_tools.py in a project folder, and no DEX_* setting at all
    files, scripts, commands = quick_start(tmp_path)
    assert list(files) == ["my_tools"] and scripts
    [dev_args] = [cmd for cmd in commands if cmd[:1] == ["dev"]]
    project = tmp_path / "project"
    project.mkdir()
    tools_file = project / "my_tools.py"
    tools_file.write_text(files["my_tools"])
    output = tmp_path / "dev.out"
    env = demo_env(marker)

    # When the reader runs `dex-tasks dev --tools my_tools` there
    with open(output, "wb") as sink:
        dev = subprocess.Popen([*dex_command(), *dev_args, "--port", "0"], cwd=project, env=env,
                               stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def out() -> str:
        return output.read_text()

    try:
        wait_until(lambda: "Press Ctrl-C" in out() or dev.poll() is not None, 90,
                   "dex-tasks dev to start")
        assert dev.poll() is None, out()
        text = out()
        assert "(embedded, redis-server from" in text
        assert "tools published: lookup_order, refund" in text, text
        # Then it prints an operator page that opens, and the exports an agent needs: a store
        # in the project folder, by its absolute path
        [page] = re.findall(r"(http://127\.0\.0\.1:\d+/sessions\?token=\S+)", text)
        opened = httpx.get(page, headers={"Accept": "text/html"}, timeout=30)
        assert opened.status_code == 200 and "text/html" in opened.headers["content-type"]
        exports = re.search(r"^\s*export (.+)$", text, re.M)
        assert exports, text
        agent_env = {k: v for k, v in env.items() if not k.startswith("DEX_")}
        agent_env.update(pair.split("=", 1) for pair in exports.group(1).split())
        assert agent_env["DEX_DATABASE_URL"] == f"sqlite:///{project.resolve() / 'dex.db'}"

        # And the agent snippet, pasted in another terminal in another folder, runs as the
        # README says (every print's comment is its output)
        agent_dir = tmp_path / "elsewhere"
        agent_dir.mkdir()
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"page": "README.md Quick start", "scripts": scripts}))
        agent_env["PYTHONPATH"] = str(ROOT)
        agent = subprocess.run([sys.executable, "-m", "tests.test_docs", str(plan)],
                               cwd=agent_dir, env=agent_env, capture_output=True, text=True,
                               timeout=120)
        assert agent.returncode == 0, agent.stdout + agent.stderr + out()

        # When the developer adds a tool and saves the file
        settings = DexSettings(redis_url=agent_env["DEX_REDIS_URL"],
                               database_url=agent_env["DEX_DATABASE_URL"])
        tools_file.write_text(files["my_tools"] + NEW_TOOL)
        # Then the worker restarts and publishes it, and a call of it runs
        wait_until(lambda: "tools published: lookup_order, ping, refund" in out(), 90,
                   "the restarted worker to publish ping")
        assert "my_tools.py changed: restarting the worker" in out()
        with DexClient(settings) as client:
            record = client.call_tool(session_id="dev-s", turn_id="t1", tool_call_id="c1",
                                      tool="ping", arguments={})
            assert client.wait(record.key, timeout=60).result == "pong"

        # When the file is saved with a syntax error: one line with the file, line and error
        tools_file.write_text(files["my_tools"] + "\ndef broken(:\n")
        wait_until(lambda: "the worker stopped:" in out(), 90, "the worker to report it")
        line = next(ln for ln in out().splitlines() if "the worker stopped:" in ln)
        lineno = len(files["my_tools"].splitlines()) + 2
        assert f"{tools_file}:{lineno}: " in line and "does not compile" in line, out()
        assert "Traceback" not in out()
        # And fixed: the worker is back
        published = out().count("tools published:")
        tools_file.write_text(files["my_tools"])
        wait_until(lambda: out().count("tools published:") > published, 90,
                   "the worker to start again once fixed")
        assert len(marked_pids(marker)) >= 5  # dev, Redis, worker (+ pool), beat, API

        # When the developer presses Ctrl-C
        os.kill(dev.pid, signal.SIGINT)
        code = dev.wait(60)
    finally:
        if dev.poll() is None:
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait(10)

    # Then it exits 0, and nothing it started is left: no process, no temporary folder; the
    # store stays in the project folder for the next run
    assert code == 0, out()
    wait_until(lambda: not marked_pids(marker), 10, "dev's processes to be gone")
    logs = re.search(r"logs\s+(\S+)", out())
    assert logs and not Path(logs.group(1)).exists()
    assert (project / "dex.db").exists()


def test_dev_names_a_tools_module_it_cannot_find(tmp_path: Path) -> None:
    result = subprocess.run([*dex_command(), "dev", "--tools", "no_such_tools", "--port", "0"],
                            cwd=tmp_path, env=demo_env(uuid.uuid4().hex), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: cannot find tool module 'no_such_tools' from {tmp_path.resolve()} (run "
        "`dex-tasks dev` in the folder that holds it, or check --tools)"]
