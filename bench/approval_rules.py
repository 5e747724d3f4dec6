"""The cost of a rule on the arguments, per call: ``python -m bench approval-rules`` (also
``python -m bench.approval_rules``; part of ``make bench``).

A rule is evaluated in the agent process when a call is made (``ToolPolicy.approval_for``,
called by ``agent.calls.new_call``). This measures that step alone, in microseconds per call,
for no rule (a plain flag), one comparison, and a nested rule of four comparisons; and
``new_call`` whole (the row built for the store) with and without a rule, so the rule's share
of a call's own CPU is visible. No store, broker or worker is involved: it is pure CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.infra import machine_info, save_results
from dex_tasks.agent.calls import checked_arguments, new_call
from dex_tasks.policy import EffectClass, ToolPolicy
from dex_tasks.rules import all_of, any_of, when
from dex_tasks.store.catalog import ToolInfo

ARGS = {"charge_id": "ch_1", "amount_cents": 25_000, "customer": {"tier": "new"}}
SCHEMA = {"type": "object", "properties": {"charge_id": {"type": "string"},
                                           "amount_cents": {"type": "integer"}}}
WRITE = EffectClass.NON_IDEMPOTENT_WRITE
POLICIES = {
    "flag (no rule)": ToolPolicy(effect=WRITE, requires_approval=True),
    "one comparison": ToolPolicy(effect=WRITE, requires_approval=when("amount_cents", ">", 10_000)),
    "four comparisons": ToolPolicy(effect=WRITE, requires_approval=any_of(
        all_of(when("amount_cents", ">", 10_000), when("customer.tier", "in", ["new"])),
        when("charge_id", "contains", "test"), when("note", "exists"))),
}


def per_call_us(fn: Callable[[], Any], n: int = 20_000, rounds: int = 5) -> float:
    """The median over ``rounds`` of the mean time of ``fn()`` over ``n`` runs, in µs."""
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        means.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(means)


def run_approval_rules(*, n: int = 20_000, out_dir: Path | None = None,
                       console: Console | None = None) -> dict[str, Any]:
    """Time ``approval_for`` and ``new_call`` per policy; print the table; write the results."""
    console = console or Console()
    _, args_json = checked_arguments(ARGS)
    rows = []
    for name, policy in POLICIES.items():
        info = ToolInfo("issue_refund", policy, None, SCHEMA)
        check = per_call_us(lambda p=policy: p.approval_for(ARGS), n=n)  # type: ignore[misc]
        whole = per_call_us(lambda i=info: new_call(  # type: ignore[misc]
            "s/t/c", "s", "t", "c", "issue_refund", ARGS, args_json, i, default_effect=None,
            approval_deadline=None, expires_in=None, default_max_attempts=3),
            n=max(1, n // 4))
        rows.append({"policy": name, "approval_for_us": round(check, 2),
                     "new_call_us": round(whole, 1)})
    console.print(f"{'policy':<20} {'approval_for':>14} {'new_call':>12}")
    for row in rows:
        console.print(f"{row['policy']:<20} {row['approval_for_us']:>11.2f} µs "
                      f"{row['new_call_us']:>9.1f} µs")
    payload = {"config": {"n": n}, "machine": machine_info(), "summary": rows, "targets": []}
    return save_results("approval_rules", payload, out_dir, console)


def main() -> None:
    run_approval_rules()


if __name__ == "__main__":
    main()
