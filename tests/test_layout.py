"""The package's folders follow its processes, and a lower layer never imports a higher one.

Layers, lowest first: the shared core (the modules at the top of ``dex_tasks``), ``store``,
``broker``, then ``agent`` and ``worker`` side by side (neither imports the other), ``api``,
and ``ops`` on top. Integrations use only the public names of ``dex_tasks``. Read with ``ast``:
nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dex_tasks"

RANK = {"": 0, "store": 1, "broker": 2, "agent": 3, "worker": 3, "examples": 3, "api": 4,
        "ops": 5}
# Entry points that re-export or wire up the layers: the package's public names and the
# module Celery's own tools load (``celery -A dex_tasks``).
ENTRY_POINTS = {"dex_tasks", "dex_tasks.celery"}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def folder(module: str, root: Path = PACKAGE) -> str:
    """The layer a module belongs to: its first folder under dex_tasks ('' for the core)."""
    parts = module.split(".")[1:]
    if len(parts) >= 1 and (root / parts[0]).is_dir():
        return parts[0]
    return ""


def imports(path: Path, module: str, root: Path = PACKAGE) -> set[str]:
    """Every dex_tasks module this file imports, at module level or inside functions."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dex_tasks"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                pkg = module.split(".")
                if path.name != "__init__.py":
                    pkg = pkg[:-1]
                base = ".".join([*pkg[: len(pkg) - node.level + 1], node.module])
            if base.startswith("dex_tasks"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    is_module = (root.parent / (sub.replace(".", "/") + ".py")).exists() or (
                        root.parent / sub.replace(".", "/")).is_dir()
                    found.add(sub if is_module else base)
    return found


def violations(root: Path = PACKAGE) -> list[str]:
    """Each import of a module by a module of a lower (or a sibling) layer, as a sentence."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        if module in ENTRY_POINTS:
            continue
        layer = folder(module, root)
        for target in sorted(imports(path, module, root)):
            if target == "dex_tasks":
                if layer != "integrations":
                    found.append(f"{module} imports the package root (use the defining module)")
                continue
            other = folder(target, root)
            if layer == "integrations":
                if other != "integrations":
                    found.append(f"{module} imports {target}: integrations use `dex_tasks` only")
                continue
            if other == "integrations":
                found.append(f"{module} imports {target}: the core never imports an integration")
            elif other != layer and (RANK[other] > RANK[layer]
                                     or (RANK[other] == RANK[layer] and other != layer)):
                found.append(f"{module} ({layer or 'core'}) imports {target} ({other})")
    return found


def test_no_layer_imports_a_higher_one() -> None:
    assert violations() == []


def test_every_folder_has_a_rank() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders - {"integrations"} == set(RANK) - {""}


def test_the_check_sees_each_kind_of_wrong_import(tmp_path: Path) -> None:
    # Given a package laid out like dex_tasks whose modules break each rule once
    root = tmp_path / "dex_tasks"
    files = {
        "__init__.py": "",
        "errors.py": "from dex_tasks.store import models\n",
        "store/__init__.py": "",
        "store/models.py": "def f():\n    from dex_tasks.worker import sweeps\n",
        "broker/__init__.py": "",
        "agent/__init__.py": "",
        "agent/client.py": "from dex_tasks.worker.sweeps import run\n",
        "worker/__init__.py": "",
        "worker/sweeps.py": ("from dex_tasks.store.models import Row\n"
                             "from dex_tasks import DexClient\n"),
        "api/__init__.py": "",
        "ops/__init__.py": "",
        "integrations/__init__.py": "",
        "integrations/x.py": "from dex_tasks.agent.client import DexClient\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    # Then every wrong import is named, and the worker's import of the store is not
    assert violations(root) == [
        "dex_tasks.agent.client (agent) imports dex_tasks.worker.sweeps (worker)",
        "dex_tasks.errors (core) imports dex_tasks.store.models (store)",
        "dex_tasks.integrations.x imports dex_tasks.agent.client: "
        "integrations use `dex_tasks` only",
        "dex_tasks.store.models (store) imports dex_tasks.worker.sweeps (worker)",
        "dex_tasks.worker.sweeps imports the package root (use the defining module)",
    ]
