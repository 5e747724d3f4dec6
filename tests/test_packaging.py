"""The wheel installs only ``dex_tasks`` (typed, with its metadata), and importing the package
imports nothing heavy until a name is used."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from tests.helpers import ROOT


def test_the_wheel_installs_only_dex_tasks_with_its_metadata(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "beat_schedule.py"):
        shutil.copy(ROOT / name, source / name)
    for package in ("dex_tasks", "workers"):
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
         str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("dex_tasks-*.whl")))
    names = wheel.namelist()
    # Then nothing but the package and its metadata: no top-level workers or beat_schedule
    assert {n.split("/")[0] for n in names} == {"dex_tasks", "dex_tasks-0.1.0.dist-info"}
    assert {"dex_tasks/py.typed", "dex_tasks/examples/tools.py",
            "dex_tasks/examples/ledger.py", "dex_tasks/worker/schedule.py"} <= set(names)
    meta = Parser().parsestr(wheel.read("dex_tasks-0.1.0.dist-info/METADATA").decode())
    assert meta["Requires-Python"] == ">=3.11"
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert any(u.startswith("Documentation, ") for u in meta.get_all("Project-URL"))
    assert {"postgres", "embedded"} <= set(meta.get_all("Provides-Extra"))
    # The CLI finds `dex-tasks mcp`'s server by its entry point, never by importing it
    points = wheel.read("dex_tasks-0.1.0.dist-info/entry_points.txt").decode()
    assert "[dex_tasks.servers]\nmcp = dex_tasks.integrations.mcp_server:serve" in points


def _modules_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return set(json.loads(out))


def test_importing_the_package_imports_nothing_heavy_until_a_name_is_used() -> None:
    heavy = {"celery", "sqlalchemy", "sqlmodel", "kombu", "redis", "fastapi", "jsonschema"}
    assert heavy & _modules_after("import dex_tasks") == set()
    # A tool module needs @tool only: no broker, store or schema validator
    tools = _modules_after("from dex_tasks import ToolContext, tool, TransientToolError")
    assert heavy & tools == set()
    # An agent process gets its client without the worker side or the API
    agent = _modules_after("from dex_tasks import DexClient")
    assert {"celery", "sqlalchemy"} <= agent
    assert not {m for m in agent if m.startswith(("dex_tasks.worker", "dex_tasks.api",
                                                    "fastapi"))}


def test_every_public_name_resolves() -> None:
    import dex_tasks

    for name in dex_tasks.__all__:
        assert getattr(dex_tasks, name) is not None, name
    assert set(dex_tasks.__all__) <= set(dir(dex_tasks))
