"""The approval benchmarks run from ``python -m bench`` and write their figures (tiny sizes;
nothing is asserted about time)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from bench.approval_rules import run_approval_rules
from bench.webhook_latency import run_webhook_latency


def test_the_rule_and_webhook_benchmarks_write_their_figures(tmp_path: Path) -> None:
    quiet = Console(file=io.StringIO(), width=200)
    rules = json.loads(Path(run_approval_rules(n=50, out_dir=tmp_path,
                                               console=quiet)["path"]).read_text())
    assert [r["policy"] for r in rules["summary"]] == [
        "flag (no rule)", "one comparison", "four comparisons"]
    assert all(r["approval_for_us"] > 0 and r["new_call_us"] > 0 for r in rules["summary"])
    hooks = json.loads(Path(run_webhook_latency(calls=3, stores=["sqlite"], postgres_url=None,
                                                out_dir=tmp_path,
                                                console=quiet)["path"]).read_text())
    [row] = hooks["summary"]
    assert row["store"] == "sqlite" and row["calls"] == 3 and row["p99_ms"] >= row["p50_ms"] > 0
