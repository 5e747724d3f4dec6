"""The README and every docs/*.md page: the site builds, and every code block runs as pasted.

A page's code is run the way a reader would run it, top to bottom:

* a ```python block whose first line is ``# name.py`` is a file the reader saves: it is written
  to a folder on the workers' and the page's ``PYTHONPATH``;
* ```bash lines that start ``dex-tasks worker --tools X`` (``dex-tasks beat``) are the
  terminals the reader opens: the test starts a real worker serving X (a real beat);
  ``dex-tasks dev --tools X`` is both (tests/test_dev.py runs the README's Quick start on the
  real ``dev``, from the exports it prints). A page that names no worker gets one serving
  ``workers.example_tools``;
* every other ```python block runs, in order, in one interpreter (the blocks share their
  names, as a reader's session does), with ``DEX_REDIS_URL`` and ``DEX_DATABASE_URL`` pointing
  at this test's private Redis and a fresh SQLite store;
* ``print(...)  # text``: a comment on a print's line is its output, and must be exactly what
  it prints (``# ... tail`` / ``# head ...``: what it ends / begins with);
* every other ``dex-tasks ...`` command in a ```bash block must parse: it is run with
  ``--help`` appended, so an unknown command or option fails.

A new page needs nothing here: every docs/*.md is picked up.
"""

from __future__ import annotations

import ast
import io
import itertools
import json
import re
import shlex
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?ms)^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```")
FILE_BLOCK = re.compile(r"#\s*([A-Za-z_][\w/]*)\.py\s*(?:[,:(].*)?$")
DEFAULT_TOOLS = "workers.example_tools"


@dataclass
class Page:
    """The code of one page, in the reader's order."""

    files: dict[str, str]
    scripts: list[str]
    shell: list[list[str]]  # each dex-tasks command's arguments

    @property
    def worker_tools(self) -> list[str]:
        tools = [arg for cmd in self.shell if cmd[:1] in (["worker"], ["dev"])
                 for opt, arg in itertools.pairwise(cmd) if opt == "--tools"]
        return tools or [DEFAULT_TOOLS]

    @property
    def wants_worker(self) -> bool:
        """A page whose code makes calls, or that tells the reader to start a worker."""
        return any(cmd[:1] in (["worker"], ["dev"]) for cmd in self.shell) \
            or any(re.search(r"\bcall_tools?\(|DexClient", script) for script in self.scripts)

    @property
    def wants_beat(self) -> bool:
        return any(cmd[:1] in (["beat"], ["dev"]) for cmd in self.shell)


def dedent(body: str, indent: str) -> str:
    return "".join(line[len(indent):] if line.startswith(indent) else line
                   for line in body.splitlines(keepends=True))


def shell_commands(script: str) -> list[list[str]]:
    """The arguments of every ``dex-tasks`` command in a bash block (comments, ``&``, ``&&``,
    ``;``, ``|`` and line continuations understood)."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # a line of a here-document or a quoted block: no command of ours
        current: list[str] = []
        for word in [*words, ";"]:
            if word in {"&&", "||", ";", "|", "&"}:
                if current[:1] == ["dex-tasks"]:
                    commands.append(current[1:])
                current = []
            else:
                current.append(word.rstrip(";&") if word.endswith((";", "&")) else word)
    return commands


def parse_page(path: Path) -> Page:
    page = Page(files={}, scripts=[], shell=[])
    for block in FENCE.finditer(path.read_text()):
        body = dedent(block["body"], block["indent"])
        if block["lang"] == "python":
            first = body.splitlines()[0] if body.strip() else ""
            named = FILE_BLOCK.fullmatch(first.strip())
            if named:
                page.files[named[1].replace("/", ".")] = body
            else:
                page.scripts.append(body)
        elif block["lang"] in {"bash", "sh", "shell", "console"}:
            page.shell.extend(shell_commands(body))
    return page


# -- running a page's python blocks (in a subprocess: ``python -m tests.test_docs PLAN``) ------


class _PrintsChecked(ast.NodeTransformer):
    """``print(a, b)  # text`` becomes ``__dex_print(text, a, b)``, which prints and compares."""

    def __init__(self, comments: dict[int, str]) -> None:
        self.comments = comments

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "print" \
                and node.end_lineno in self.comments and not node.keywords:
            expected = ast.Constant(self.comments[node.end_lineno])
            return ast.copy_location(
                ast.Call(ast.Name("__dex_print", ast.Load()), [expected, *node.args], []), node)
        return node


def compile_block(source: str, name: str) -> Any:
    comments = {tok.start[0]: tok.string[1:].strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    tree = _PrintsChecked(comments).visit(ast.parse(source, name))
    return compile(ast.fix_missing_locations(tree), name, "exec")


def _dex_print(expected: str, *values: object) -> None:
    shown = " ".join(str(v) for v in values)
    print(shown)
    # "... tail" and "head ..." say the output ends (begins) with the rest of the comment.
    if expected.startswith("... "):
        matches = shown.endswith(expected[4:])
    elif expected.endswith(" ..."):
        matches = shown.startswith(expected[:-4])
    else:
        matches = shown == expected
    if not matches:
        raise AssertionError(f"printed {shown!r}, the comment says {expected!r}")


def run_scripts(plan_path: str) -> None:
    """Run a page's script blocks in order, in one namespace, naming the block that fails."""
    plan = json.loads(Path(plan_path).read_text())
    namespace: dict[str, Any] = {"__name__": "__main__", "__dex_print": _dex_print}
    for index, source in enumerate(plan["scripts"], 1):
        code = compile_block(source, f"<{plan['page']} python block {index}>")
        exec(code, namespace)


if __name__ == "__main__":
    run_scripts(sys.argv[1])


# -- the tests ---------------------------------------------------------------------------------


def test_the_site_builds_with_strict_checks(tmp_path: Path) -> None:
    # Strict: a broken link, an anchor that does not exist, a page missing from the nav or a
    # docstring mkdocstrings cannot read fails the build.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**_clean_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count("DexClient") > 5


def test_every_docs_page_is_in_the_nav() -> None:
    import yaml

    def pages(entry: Any) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [p for item in entry for p in pages(item)]
        return [p for value in entry.values() for p in pages(value)]

    nav = pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    on_disk = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == on_disk


def test_every_setting_is_on_the_configuration_page() -> None:
    from dex_tasks import DexSettings

    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `(DEX_[A-Z_]+)`", page, re.M))
    rows |= {name for line in re.findall(r"^\| (`DEX_[^|]+)\|", page, re.M)
             for name in re.findall(r"`(DEX_[A-Z_]+)`", line)}
    fields = {f"DEX_{name.upper()}" for name in DexSettings.model_fields}
    assert fields - rows == set(), "settings missing from docs/configuration.md"
    assert rows - fields == set(), "rows of docs/configuration.md for no setting"


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 10_240
    for heading in ("## Requirements", "## Install", "## The two commands", "## Quick start",
                    "## Documentation", "## How the code is laid out"):
        assert heading in readme
    assert "Python >= 3.11" in readme and "PostgreSQL" in readme and "[postgres]" in readme
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_no_page_has_two_sections_of_the_same_name(path: Path) -> None:
    # (getting-started once had two "Install" sections that disagreed on the extras)
    text = FENCE.sub("", path.read_text())
    headings = re.findall(r"^(#{2,3} .+)$", text, re.M)
    assert len(headings) == len(set(headings)), sorted(h for h in headings
                                                       if headings.count(h) > 1)


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_every_dex_tasks_command_in_a_page_parses(path: Path) -> None:
    from typer.testing import CliRunner

    from dex_tasks.ops.cli import app

    runner = CliRunner()
    for args in parse_page(path).shell:
        result = runner.invoke(app, [*args, "--help"])
        assert result.exit_code == 0, f"`dex-tasks {shlex.join(args)}`:\n{result.output}"


def test_a_print_whose_comment_is_not_its_output_fails() -> None:
    # The check the page runner relies on, without a worker: the comment is the output.
    namespace: dict[str, Any] = {"__dex_print": _dex_print}
    exec(compile_block("x = 2\nprint(x + 1)  # 3\n", "<ok>"), namespace)
    with pytest.raises(AssertionError, match="printed '3', the comment says '4'"):
        exec(compile_block("print(\n    x + 1)   # 4\n", "<wrong>"), namespace)


SCRIPTED = [p for p in PAGES if parse_page(p).scripts or parse_page(p).files]


@pytest.mark.parametrize("path", SCRIPTED, ids=[p.name for p in SCRIPTED])
def test_every_python_block_of_a_page_runs_as_pasted(
        path: Path, tmp_path: Path, redis_url: str) -> None:
    from tests.conftest import fast_settings, settings_env
    from tests.helpers import WorkerProcess, start_process

    page = parse_page(path)
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    for module, source in page.files.items():
        target = code_dir / (module.replace(".", "/") + ".py")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    env = settings_env(fast_settings(redis_url, f"sqlite:///{tmp_path / 'dex.db'}"),
                       tmp_path / "ledger.jsonl")
    env["PYTHONPATH"] = f"{code_dir}:{ROOT}"
    # The reader's environment is activated: its dex-tasks is on PATH.
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    # A file no worker serves must still import (its tools register, its reconcilers attach).
    served = {m for tools in page.worker_tools for m in tools.split(",")}
    for module in set(page.files) - served:
        imported = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=code_dir,
                                  env=env, capture_output=True, text=True, timeout=60)
        assert imported.returncode == 0, f"{module}.py:\n{imported.stderr}"
    if not page.scripts:
        return
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for n, tools in enumerate(page.worker_tools if page.wants_worker else []):
            log = tmp_path / f"worker-{n}.log"
            procs.append(start_process(["worker", "--tools", tools, "-c", "2"], env, log))
            WorkerProcess(procs[-1], log).wait_ready(60)
        if page.wants_beat:
            procs.append(start_process(["beat"], env, tmp_path / "beat.log"))
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"page": path.name, "scripts": page.scripts}))
        result = subprocess.run([sys.executable, "-m", "tests.test_docs", str(plan)],
                                cwd=code_dir, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, (f"{path.name}: a python block failed\n"
                                        f"{result.stdout}\n{result.stderr}")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
