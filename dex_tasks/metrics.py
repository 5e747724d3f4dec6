"""Prometheus metrics, computed from the store (and Redis) at scrape time.

Workers, beats and API replicas are many processes; counters kept in any one of them would be
partial. The store already holds every call, so each scrape asks it: one ``GROUP BY`` for the
call counts, one for pending approvals, one bucketed aggregate for latency. Sweep results come
from a small Redis hash that :func:`record_sweep` updates after every sweep run.

Exposed:

* ``dex_tool_calls{tool,effect,status}`` (gauge): calls in the store by tool, effect class and
  status.
* ``dex_pending_approvals{tool}`` and ``dex_overdue_approvals`` (gauges): calls awaiting a
  decision, and those whose deadline passed without the sweep rejecting them yet (a beat that
  is not running shows here).
* ``dex_tool_call_latency_seconds{tool,effect,status}`` (gauge histogram): enqueue-to-terminal
  time of the calls that finished in the last ``window`` seconds. It is a window, not a
  running total, so read it directly (``histogram_quantile(0.95, sum by (le)
  (dex_tool_call_latency_seconds_bucket))``), without ``rate()``.
* ``dex_sweep_runs_total{job}``, ``dex_sweep_moved_total{job}`` (counters) and
  ``dex_sweep_last_run_timestamp_seconds{job}``: what each beat job did.
* ``dex_store_up``, ``dex_redis_up``: whether this scrape could read them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
)
from prometheus_client.registry import Collector
from sqlalchemy import and_, case, func, select

from dex_tasks.errors import DexError
from dex_tasks.redis_clients import redis_client
from dex_tasks.settings import DexSettings
from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, INTERRUPTS

if TYPE_CHECKING:
    import redis

    from dex_tasks.store import Store

log = logging.getLogger("dex_tasks.metrics")

LATENCY_WINDOW_SECONDS = 300.0
"""How far back the latency histogram looks (calls finished within this many seconds)."""

LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
)
"""Upper bounds (seconds) of the latency buckets; approvals make the long tail real."""

SWEEP_STATS_KEY = "dex:sweep-stats"
"""Redis hash: ``<job>:runs``, ``<job>:moved``, ``<job>:last_run`` for every sweep job."""


def record_sweep(client: redis.Redis, job: str, moved: int, now: float | None = None) -> None:
    """Add one run of ``job`` that moved ``moved`` calls to the shared sweep statistics."""
    now = time.time() if now is None else now
    pipe = client.pipeline(transaction=False)
    pipe.hincrby(SWEEP_STATS_KEY, f"{job}:runs", 1)
    pipe.hincrby(SWEEP_STATS_KEY, f"{job}:moved", int(moved))
    pipe.hset(SWEEP_STATS_KEY, f"{job}:last_run", repr(now))
    pipe.execute()


class StoreCollector(Collector):
    """Builds every metric family from the store and Redis when Prometheus scrapes."""

    def __init__(self, store: Store, redis_client: redis.Redis | None = None, *,
                 now: float | None = None, window: float = LATENCY_WINDOW_SECONDS) -> None:
        self.store = store
        self.redis = redis_client
        self.now = now
        self.window = window

    def collect(self) -> Iterator[Any]:
        now = time.time() if self.now is None else self.now
        store_up = GaugeMetricFamily("dex_store_up", "1 if this scrape could read the store.")
        try:
            families = list(self._store_families(now))
        except DexError as err:
            log.warning("metrics could not read the store",
                        extra={"action": "metrics_store_error", "error": str(err)})
            families = []
            store_up.add_metric([], 0)
        else:
            store_up.add_metric([], 1)
        yield store_up
        yield from families
        if self.redis is not None:
            yield from self._sweep_families()

    # -- store ----------------------------------------------------------------------------------

    def _store_families(self, now: float) -> Iterator[Any]:
        with self.store.read() as conn:
            by_status = conn.execute(
                select(CALLS.c.tool, CALLS.c.effect, CALLS.c.status, func.count())
                .group_by(CALLS.c.tool, CALLS.c.effect, CALLS.c.status)
            ).all()
            overdue = conn.execute(
                select(func.count())
                .select_from(INTERRUPTS.join(CALLS, CALLS.c.key == INTERRUPTS.c.key))
                .where(
                    CALLS.c.status == CallStatus.AWAITING_APPROVAL.value,
                    INTERRUPTS.c.decision.is_(None),
                    INTERRUPTS.c.deadline_at < now,
                )
            ).scalar_one()
            latency = conn.execute(self._latency_query(now)).all()

        calls = GaugeMetricFamily(
            "dex_tool_calls", "Tool calls in the store, by tool, effect class and status.",
            labels=["tool", "effect", "status"],
        )
        pending = GaugeMetricFamily(
            "dex_pending_approvals", "Calls awaiting a human decision, by tool.", labels=["tool"],
        )
        for tool, effect, status, count in by_status:
            calls.add_metric([tool, effect, status], count)
            if status == CallStatus.AWAITING_APPROVAL.value:
                pending.add_metric([tool], count)
        yield calls
        yield pending
        yield GaugeMetricFamily(
            "dex_overdue_approvals",
            "Calls still awaiting approval after their deadline (the deadline sweep is behind).",
            value=overdue,
        )
        yield self._latency_family(latency)

    def _latency_query(self, now: float) -> Any:
        elapsed = CALLS.c.finished_at - CALLS.c.created_at
        buckets = [
            func.sum(case((elapsed <= bound, 1), else_=0)) for bound in LATENCY_BUCKETS
        ]
        return (
            select(CALLS.c.tool, CALLS.c.effect, CALLS.c.status, func.count(),
                   func.sum(elapsed), *buckets)
            .where(and_(CALLS.c.finished_at.is_not(None),
                        CALLS.c.finished_at >= now - self.window))
            .group_by(CALLS.c.tool, CALLS.c.effect, CALLS.c.status)
        )

    def _latency_family(self, rows: Sequence[Any]) -> GaugeHistogramMetricFamily:
        family = GaugeHistogramMetricFamily(
            "dex_tool_call_latency_seconds",
            f"Enqueue-to-terminal time of calls finished in the last {self.window:g}s "
            "(a window, not a running total).",
            labels=["tool", "effect", "status"],
        )
        for row in rows:
            tool, effect, status, count, total = row[:5]
            cumulative = [(_le(bound), float(n or 0)) for bound, n in
                          zip(LATENCY_BUCKETS, row[5:], strict=True)]
            cumulative.append(("+Inf", float(count)))
            family.add_metric([tool, effect, status], cumulative, float(total or 0.0))
        return family

    # -- redis ----------------------------------------------------------------------------------

    def _sweep_families(self) -> Iterator[Any]:
        assert self.redis is not None
        redis_up = GaugeMetricFamily("dex_redis_up", "1 if this scrape could read Redis.")
        try:
            raw = self.redis.hgetall(SWEEP_STATS_KEY)
        except Exception as err:  # noqa: BLE001 - a scrape reports Redis down, it never fails
            log.warning("metrics could not read Redis",
                        extra={"action": "metrics_redis_error", "error": str(err)})
            redis_up.add_metric([], 0)
            yield redis_up
            return
        redis_up.add_metric([], 1)
        yield redis_up
        stats: dict[str, dict[str, float]] = {}
        for field, value in raw.items():
            name = field.decode() if isinstance(field, bytes) else str(field)
            job, _, what = name.rpartition(":")
            stats.setdefault(job, {})[what] = float(value)
        runs = CounterMetricFamily("dex_sweep_runs", "Sweep job runs, by job.", labels=["job"])
        moved = CounterMetricFamily(
            "dex_sweep_moved", "Calls a sweep job acted on (reaped, republished, expired).",
            labels=["job"],
        )
        last = GaugeMetricFamily(
            "dex_sweep_last_run_timestamp_seconds", "When each sweep job last ran (epoch).",
            labels=["job"],
        )
        for job, values in sorted(stats.items()):
            runs.add_metric([job], values.get("runs", 0.0))
            moved.add_metric([job], values.get("moved", 0.0))
            if "last_run" in values:
                last.add_metric([job], values["last_run"])
        yield runs
        yield moved
        yield last


def metrics_redis(settings: DexSettings) -> redis.Redis:
    """One Redis client per Redis configuration per process for scrapes (short timeouts: a
    scrape must not hang on a dead Redis)."""
    return _metrics_redis(settings.model_dump_json(include=set(_REDIS_FIELDS)))


_REDIS_FIELDS = ("redis_url", "redis_sentinel_master", "redis_tls_ca_file",
                 "redis_tls_cert_file", "redis_tls_key_file")


@functools.lru_cache(maxsize=4)
def _metrics_redis(redis_settings: str) -> redis.Redis:
    settings = DexSettings.model_validate_json(redis_settings)
    return redis_client(settings, socket_timeout=2, socket_connect_timeout=2)


def _le(bound: float) -> str:
    return repr(float(bound))


def render_metrics(store: Store, redis_client: redis.Redis | None = None, *,
                   now: float | None = None,
                   window: float = LATENCY_WINDOW_SECONDS) -> tuple[bytes, str]:
    """The Prometheus text exposition of dex-tasks and its content type, computed now.

    Never raises for an unreachable store or Redis: the scrape says so in ``dex_store_up`` and
    ``dex_redis_up`` instead, which is what an alert wants to see.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, redis_client, now=now, window=window))
    return generate_latest(registry), CONTENT_TYPE_LATEST
