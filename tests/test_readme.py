"""The guarantees table (docs/guarantees.md) names the tests behind each guarantee, and the README
and the other docs pages name tests too: every name must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_test_the_readme_names_exists() -> None:
    pages = [ROOT / "docs" / "guarantees.md", ROOT / "README.md",
             *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "guarantees.md")]
    text = "\n".join(p.read_text() for p in pages)
    named: list[str] = []
    missing: list[str] = []
    current: Path | None = None
    # A cell names `test_file.py` or `test_file.py::test_name`, then `::other_test` for more
    # tests of the same file.
    for token in re.findall(r"`([^`\n]+)`", text):
        if re.fullmatch(r"test_\w+\.py(::\w+)*(\[[^\]]*\])?", token):
            file, _, name = token.partition("::")
            current = ROOT / "tests" / file
        elif re.fullmatch(r"(::\w+)+(\[[^\]]*\])?", token) and current is not None:
            file, name = current.name, token[2:]
        else:
            continue
        named.append(token)
        if not current.exists():
            missing.append(token)
        elif name and f"def {name.split('[')[0].split('::')[-1]}(" not in current.read_text():
            missing.append(f"{file}::{name}")
    assert len(named) > 20, "the guarantees table should name the tests behind it"
    assert missing == []
