"""The load of a chaos run: the planned mix of calls, the agents making them, and the person
approving refunds."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from chaos.checks import APPROVE, EXPIRE, Tally
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.store import CALLS, Store

log = logging.getLogger("chaos.load")

ACTIVE = (CallStatus.QUEUED.value, CallStatus.RUNNING.value)

# Share of each kind of call in the load.
MIX: dict[str, float] = {
    "read": 0.274,
    "slow_read": 0.006,
    "flaky_read": 0.15,
    "idempotent_write": 0.2,
    "charge": 0.196,
    "slow_charge": 0.004,
    "refund_approved": 0.11,
    "refund_expiring": 0.06,
}


@dataclass(frozen=True)
class CallSpec:
    """One call the driver will make."""

    index: int
    kind: str
    tool: str
    arguments: dict[str, Any]
    approval_deadline: float | None = None

    @property
    def ids(self) -> tuple[str, str, str]:
        """(session, turn, tool call) ids: 40 sessions, one turn per call."""
        return f"chaos-{self.index % 40}", f"t{self.index}", "c0"

    @property
    def key(self) -> str:
        return "/".join(self.ids)


def plan(calls: int, rng: random.Random, slow: float = 5.0) -> list[CallSpec]:
    """A random mixed load of ``calls`` calls (see :data:`MIX`); slow ones take ``slow`` s."""
    kinds = list(MIX)
    weights = [MIX[k] for k in kinds]
    specs = []
    for i in range(calls):
        kind = rng.choices(kinds, weights)[0]
        order = str(1001 + i % 2)
        if kind in ("read", "slow_read"):
            sleep = slow if kind == "slow_read" else round(rng.uniform(0, 0.3), 3)
            specs.append(CallSpec(i, kind, "lookup_order", {"order_id": order, "sleep": sleep}))
        elif kind == "flaky_read":
            specs.append(CallSpec(i, kind, "flaky_read",
                                  {"order_id": order, "fail_rate": 0.3,
                                   "sleep": round(rng.uniform(0, 0.1), 3)}))
        elif kind == "idempotent_write":
            specs.append(CallSpec(i, kind, "update_address",
                                  {"order_id": order, "address": f"{i} Main St",
                                   "sleep": round(rng.uniform(0, 0.3), 3)}))
        elif kind in ("charge", "slow_charge"):
            sleep = slow if kind == "slow_charge" else round(rng.uniform(0, 0.4), 3)
            specs.append(CallSpec(i, kind, "charge_card",
                                  {"customer_id": f"cu_{i}", "amount_cents": 100 + i,
                                   "sleep": sleep}))
        else:
            # Approved ones wait with no deadline; the others expire after 1-3 s.
            deadline = round(rng.uniform(1.0, 3.0), 2) if kind == "refund_expiring" else None
            specs.append(CallSpec(i, kind, "refund_payment",
                                  {"charge_id": f"ch_{i}", "amount_cents": 50 + i},
                                  approval_deadline=deadline))
    return specs


class Driver:
    """Agents calling tools at a steady pace (never more than ``cap`` calls in flight), and a
    person approving the refunds meant to be approved, each after a moment."""

    def __init__(self, settings: DexSettings, tally: Tally, rng: random.Random,
                 stop: threading.Event) -> None:
        self.settings = settings
        self.tally = tally
        self.rng = rng
        self.stop = stop
        self.intents: dict[str, str] = {}
        self.in_flight = 0
        self.lock = threading.Lock()
        self.approvals: queue.PriorityQueue[tuple[float, int, str, str, str]] = (
            queue.PriorityQueue()
        )
        self.helpers: list[threading.Thread] = []

    def start_helpers(self) -> None:
        """Start the in-flight monitor and the approver; they run until ``stop`` is set."""
        self.helpers = [threading.Thread(target=self._monitor, name="chaos-monitor", daemon=True),
                        threading.Thread(target=self._approve, name="chaos-approver",
                                         daemon=True)]
        for thread in self.helpers:
            thread.start()

    def join_helpers(self) -> None:
        for thread in self.helpers:
            thread.join(10)

    def submit_all(self, specs: list[CallSpec], duration: float, threads: int, cap: int) -> None:
        """Make every call, spread over ``duration`` seconds; returns when all are made."""
        iterator = iter(specs)
        spacing = duration / max(1, len(specs))
        started = time.monotonic()
        submitters = [threading.Thread(target=self._submit,
                                       args=(iterator, started, spacing, cap),
                                       name=f"chaos-driver-{i}", daemon=True)
                      for i in range(threads)]
        for thread in submitters:
            thread.start()
        for thread in submitters:
            thread.join()

    def _monitor(self) -> None:
        store = Store(self.settings.database_url)
        try:
            while not self.stop.wait(0.2):
                try:
                    with store.read() as conn:
                        self.in_flight = int(conn.execute(
                            select(func.count()).select_from(CALLS)
                            .where(CALLS.c.status.in_(ACTIVE))
                        ).scalar_one())
                except Exception:
                    log.warning("in-flight count failed", exc_info=True)
        finally:
            store.close()

    def _submit(self, specs: Iterator[CallSpec], started: float, spacing: float,
                cap: int) -> None:
        client = DexClient(self.settings, create_tables=False)
        try:
            while not self.stop.is_set():
                with self.lock:
                    spec = next(specs, None)
                if spec is None:
                    return
                pause = started + spec.index * spacing - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                while self.in_flight >= cap and not self.stop.is_set():
                    time.sleep(0.02)
                self._call(client, spec)
        finally:
            client.close()

    def _call(self, client: DexClient, spec: CallSpec) -> None:
        session, turn, call_id = spec.ids
        if spec.kind == "refund_expiring":
            self.intents[spec.key] = EXPIRE
        elif spec.kind == "refund_approved":
            self.intents[spec.key] = APPROVE
        try:
            record = client.call_tool(session_id=session, turn_id=turn, tool_call_id=call_id,
                                      tool=spec.tool, arguments=spec.arguments,
                                      approval_deadline=spec.approval_deadline)
        except Exception as err:  # noqa: BLE001 - reported as a violation
            self.tally.count("driver.call_tool_errors")
            self.tally.problem(f"call_tool_raised: {spec.key}: {type(err).__name__}: {err}")
            return
        self.tally.count("driver.calls")
        if record.status is CallStatus.FAILED:
            self.tally.count("driver.failed_at_call")
        if spec.kind == "refund_approved" and record.interrupt_id:
            due = time.monotonic() + self.rng.uniform(0.2, 1.5)
            self.approvals.put((due, spec.index, session, record.interrupt_id, spec.key))

    def _approve(self) -> None:
        client = DexClient(self.settings, create_tables=False)
        try:
            while not self.stop.is_set():
                try:
                    due, index, session, interrupt_id, key = self.approvals.get(timeout=0.2)
                except queue.Empty:
                    continue
                # One reading of the clock: reading it again for the sleep could find the due
                # time passed meanwhile, and a negative sleep raised and ended this thread,
                # leaving every later approval undecided (a loaded chaos run failed so).
                wait = due - time.monotonic()
                if wait > 0:
                    self.approvals.put((due, index, session, interrupt_id, key))
                    time.sleep(min(wait, 0.05))
                    continue
                try:
                    decided = client.resolve_interrupt(session, interrupt_id, True,
                                                       approver="chaos-driver")
                except Exception:  # noqa: BLE001 - the store was busy: the call is retry-safe
                    self.tally.count("approvals.retried")
                    self.approvals.put((time.monotonic() + 0.5, index, session, interrupt_id,
                                        key))
                    continue
                if decided:
                    self.tally.count("approvals.approved")
                elif client.get_tool_call(key).status is CallStatus.AWAITING_APPROVAL:
                    self.tally.problem(f"approval_refused: {key}: resolve_interrupt returned "
                                       "False for a pending call")
        finally:
            client.close()
