"""Prometheus metrics: counters kept in Redis as calls end, and gauges of the open calls.

Workers, beats and API replicas are many processes; counters kept in any one of them would be
partial, so they live in Redis, shared by all. A scrape never reads the store's ended calls:
it would cost more with every call ever made (a whole-table scan took 2 s per scrape at 500k
calls). Instead:

* every committed transaction that ends calls counts them, in the same Redis round trip that
  wakes their waiters (``announce.EndedNotifier`` calls :func:`count_ended`): by tool, effect
  class and status, and into latency buckets (enqueue to terminal);
* the gauges that must be current (calls awaiting approval, queued, running) come from one
  query over the open statuses only, through the ``(status, tool, effect)`` index, so its cost
  follows the open calls and not the ended ones;
* sweep results come from a small Redis hash that :func:`record_sweep` updates.

Exposed:

* ``dex_tool_calls_ended_total{tool,effect,status}`` (counter): calls that ended.
* ``dex_tool_call_duration_seconds{tool,effect,status}`` (histogram): enqueue-to-terminal
  time of the calls that ended, e.g. ``histogram_quantile(0.95, sum by (le)
  (rate(dex_tool_call_duration_seconds_bucket[5m])))``.
* ``dex_tool_calls_open{tool,effect,status}`` (gauge): calls awaiting approval, queued or
  running, now.
* ``dex_pending_approvals{tool}`` and ``dex_overdue_approvals`` (gauges): calls awaiting a
  decision, and those whose deadline passed without the sweep rejecting them yet (a beat that
  is not running shows here).
* ``dex_oldest_pending_approval_age_seconds`` (gauge): how long the oldest undecided approval
  has waited (0 with none).
* ``dex_sweep_runs_total{sweep}``, ``dex_sweep_moved_total{sweep}`` (counters) and
  ``dex_sweep_last_run_timestamp_seconds{sweep}``: what each beat job did. The label is
  ``sweep``, not ``job``, which Prometheus's own scrape label would rename ``exported_job``.
* ``dex_beat_last_sweep_age_seconds`` (gauge): seconds since any sweep last ran (absent before
  the first); past :data:`BEAT_LATE_INTERVALS` sweep intervals no beat is running, and approval
  deadlines, lease reaping and republishing have stopped.
* ``dex_workers_alive`` (gauge): workers whose announcement has not expired.
* ``dex_store_up``, ``dex_redis_up``: whether this scrape could read them.

The counters are as durable as Redis (AOF in production). While Redis cannot be reached, the
calls that end are not counted (nothing runs then either: Redis is the broker); a Redis that
lost its data starts the counters again from zero, which ``rate()`` treats as a reset.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from dex_tasks.broker.redis_clients import redis_client
from dex_tasks.broker.routing import live_workers
from dex_tasks.broker.runs import Runs
from dex_tasks.errors import DexError
from dex_tasks.settings import DexSettings
from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, INTERRUPTS

if TYPE_CHECKING:
    import redis

    from dex_tasks.store import EndedCall, Store

log = logging.getLogger("dex_tasks.broker.metrics")

LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
)
"""Upper bounds (seconds) of the latency buckets; approvals make the long tail real."""

ENDED_KEY = "dex:metrics:ended"
"""Redis hash of the ended-call counters. Each field is a JSON list ``[tool, effect, status,
bucket]``: ``bucket`` is the index in :data:`LATENCY_BUCKETS` of the first bound the call's
latency fits under (``len(LATENCY_BUCKETS)`` for none), or ``"sum"`` for the latency total."""

OPEN_STATUSES = (CallStatus.AWAITING_APPROVAL, CallStatus.QUEUED, CallStatus.RUNNING)
"""The statuses of calls not ended yet: the only ones a scrape reads from the store."""

SWEEP_STATS_KEY = "dex:sweep-stats"
"""Redis hash: ``<job>:runs``, ``<job>:moved``, ``<job>:last_run`` for every sweep job."""


BEAT_LATE_INTERVALS = 3
"""A beat counts as missing when no sweep ran for this many ``DEX_SWEEP_INTERVAL_SECONDS``."""


def last_sweep_at(client: redis.Redis) -> float | None:
    """When any sweep last ran (epoch seconds), from the shared sweep statistics; None if
    none ever did."""
    runs = [float(v) for f, v in client.hgetall(SWEEP_STATS_KEY).items()
            if _text(f).endswith(":last_run")]
    return max(runs) if runs else None


def beat_is_late(last_run: float | None, interval: float, now: float | None = None) -> bool:
    """True when no sweep ran within :data:`BEAT_LATE_INTERVALS` intervals (or ever)."""
    now = time.time() if now is None else now
    return last_run is None or now - last_run > BEAT_LATE_INTERVALS * interval


def record_sweep(client: redis.Redis, job: str, moved: int, now: float | None = None) -> None:
    """Add one run of ``job`` that moved ``moved`` calls to the shared sweep statistics."""
    now = time.time() if now is None else now
    pipe = client.pipeline(transaction=False)
    pipe.hincrby(SWEEP_STATS_KEY, f"{job}:runs", 1)
    pipe.hincrby(SWEEP_STATS_KEY, f"{job}:moved", int(moved))
    pipe.hset(SWEEP_STATS_KEY, f"{job}:last_run", repr(now))
    pipe.execute()


WEBHOOKS_KEY = "dex:metrics:webhooks"
"""Redis hash of webhook delivery attempts by outcome (delivered, retried, failed, skipped)."""


def count_webhook(client: redis.Redis, outcome: str) -> None:
    """Count one webhook delivery attempt (``dex_webhook_deliveries_total{outcome}``)."""
    client.hincrby(WEBHOOKS_KEY, outcome, 1)


def _field(tool: str, effect: str, status: str, bucket: int | str) -> str:
    return json.dumps([tool, effect, status, bucket], separators=(",", ":"))


# Every call that ends needs two of these names; a worker serves a bounded set of label sets
# (its tools x effect x status), so they are built once each instead of JSON-encoded per call.
@functools.lru_cache(maxsize=4096)
def _fields(tool: str, effect: str, status: str) -> tuple[tuple[str, ...], str]:
    """The hash fields of one label set: one per latency bucket, and the latency total's."""
    buckets = tuple(_field(tool, effect, status, i) for i in range(len(LATENCY_BUCKETS) + 1))
    return buckets, _field(tool, effect, status, "sum")


def bucket_of(seconds: float) -> int:
    """The index of the first bound of :data:`LATENCY_BUCKETS` that ``seconds`` fits under
    (``len(LATENCY_BUCKETS)``: above them all)."""
    return bisect.bisect_left(LATENCY_BUCKETS, seconds)


def ended_counts(ended: Sequence[EndedCall]) -> tuple[dict[str, int], dict[str, float]]:
    """The counter updates for ``ended``: ``HINCRBY`` amounts by field (one per label set and
    bucket) and ``HINCRBYFLOAT`` latency totals by field (one per label set), in
    :data:`ENDED_KEY`."""
    counts: dict[str, int] = {}
    totals: dict[str, float] = {}
    for call in ended:
        buckets, total = _fields(call.tool, call.effect, call.status.value)
        latency = max(0.0, call.finished_at - call.created_at)
        name = buckets[bucket_of(latency)]
        counts[name] = counts.get(name, 0) + 1
        totals[total] = totals.get(total, 0.0) + latency
    return counts, totals


def count_ended(pipe: Any, ended: Sequence[EndedCall]) -> None:
    """Queue on Redis pipeline ``pipe`` the counter updates for ``ended`` (one ``HINCRBY`` per
    label set and bucket, one ``HINCRBYFLOAT`` per label set for the latency total)."""
    counts, totals = ended_counts(ended)
    for name, n in counts.items():
        pipe.hincrby(ENDED_KEY, name, n)
    for name, seconds in totals.items():
        pipe.hincrbyfloat(ENDED_KEY, name, seconds)


class StoreCollector(Collector):
    """Builds every metric family from Redis and the store's open calls when Prometheus
    scrapes."""

    def __init__(self, store: Store, redis_client: redis.Redis | None = None, *,
                 now: float | None = None) -> None:
        self.store = store
        self.redis = redis_client
        self.now = now

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
            yield from self._redis_families()

    # -- store: open calls only -----------------------------------------------------------------

    def _store_families(self, now: float) -> Iterator[Any]:
        with self.store.read() as conn:
            by_status = conn.execute(open_calls_query()).all()
            overdue = conn.execute(
                select(func.count())
                .select_from(INTERRUPTS.join(CALLS, CALLS.c.key == INTERRUPTS.c.key))
                .where(
                    CALLS.c.status == CallStatus.AWAITING_APPROVAL.value,
                    INTERRUPTS.c.decision.is_(None),
                    INTERRUPTS.c.deadline_at < now,
                )
            ).scalar_one()
            oldest = conn.execute(
                select(func.min(INTERRUPTS.c.created_at)).where(INTERRUPTS.c.decision.is_(None))
            ).scalar_one()

        calls = GaugeMetricFamily(
            "dex_tool_calls_open",
            "Calls not ended yet (awaiting approval, queued, running), by tool, effect class "
            "and status.",
            labels=["tool", "effect", "status"],
        )
        pending = GaugeMetricFamily(
            "dex_pending_approvals", "Calls awaiting a human decision, by tool.", labels=["tool"],
        )
        for tool, effect, status, count in self._with_running(by_status):
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
        yield GaugeMetricFamily(
            "dex_oldest_pending_approval_age_seconds",
            "How long the oldest undecided approval has waited (0 with none).",
            value=0.0 if oldest is None else max(0.0, now - float(oldest)),
        )

    def _with_running(self, by_status: Sequence[Any]) -> list[tuple[str, str, str, int]]:
        """The store's open counts with the retrying calls that run under a lease in Redis
        (``queued`` in the store) counted ``running``. Redis unreachable: as stored."""
        counts = {(t, e, s): int(n) for t, e, s, n in by_status}
        if self.redis is None:
            return [(*k, n) for k, n in counts.items()]
        try:
            running = Runs(self.redis).running_by_label()
        except Exception as err:  # noqa: BLE001 - a scrape never fails on Redis
            log.debug("running calls not read from Redis: %s", err)
            running = {}
        queued, run = CallStatus.QUEUED.value, CallStatus.RUNNING.value
        for (tool, effect), n in running.items():
            moved = min(n, counts.get((tool, effect, queued), 0))
            if moved:
                counts[(tool, effect, queued)] -= moved
                counts[(tool, effect, run)] = counts.get((tool, effect, run), 0) + moved
        return [(*k, n) for k, n in counts.items()]

    # -- redis: counters ------------------------------------------------------------------------

    def _redis_families(self) -> Iterator[Any]:
        assert self.redis is not None
        redis_up = GaugeMetricFamily("dex_redis_up", "1 if this scrape could read Redis.")
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(ENDED_KEY)
            pipe.hgetall(SWEEP_STATS_KEY)
            pipe.hgetall(WEBHOOKS_KEY)
            ended_raw, sweeps_raw, webhooks_raw = pipe.execute()
            workers = len(live_workers(self.redis))
        except Exception as err:  # noqa: BLE001 - a scrape reports Redis down, it never fails
            log.warning("metrics could not read Redis",
                        extra={"action": "metrics_redis_error", "error": str(err)})
            redis_up.add_metric([], 0)
            yield redis_up
            return
        redis_up.add_metric([], 1)
        yield redis_up
        yield from _ended_families(ended_raw)
        yield from _sweep_families(sweeps_raw, time.time() if self.now is None else self.now)
        yield GaugeMetricFamily("dex_workers_alive",
                                "Workers whose announcement in Redis has not expired.",
                                value=workers)
        deliveries = CounterMetricFamily(
            "dex_webhook_deliveries", "Webhook delivery attempts, by outcome.",
            labels=["outcome"])
        for outcome, n in sorted(webhooks_raw.items()):
            deliveries.add_metric([_text(outcome)], float(n))
        yield deliveries


def open_calls_query() -> Any:
    """Open calls counted by tool, effect class and status: reads only the open statuses'
    entries of the ``(status, tool, effect)`` index, never an ended call."""
    return (
        select(CALLS.c.tool, CALLS.c.effect, CALLS.c.status, func.count())
        .where(CALLS.c.status.in_([s.value for s in OPEN_STATUSES]))
        .group_by(CALLS.c.status, CALLS.c.tool, CALLS.c.effect)
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ended_families(raw: dict[Any, Any]) -> Iterator[Any]:
    buckets: dict[tuple[str, str, str], list[float]] = {}
    sums: dict[tuple[str, str, str], float] = {}
    for name, value in raw.items():
        try:
            tool, effect, status, bucket = json.loads(_text(name))
            labels = (str(tool), str(effect), str(status))
            if bucket == "sum":
                sums[labels] = float(value)
            else:
                counts = buckets.setdefault(labels, [0.0] * (len(LATENCY_BUCKETS) + 1))
                counts[int(bucket)] += float(value)
        except (ValueError, TypeError, IndexError):
            log.warning("unreadable metrics field skipped",
                        extra={"action": "metrics_field_unreadable", "field": ascii(name)})
    ended = CounterMetricFamily(
        "dex_tool_calls_ended", "Calls that ended, by tool, effect class and status.",
        labels=["tool", "effect", "status"],
    )
    duration = HistogramMetricFamily(
        "dex_tool_call_duration_seconds",
        "Enqueue-to-terminal time of the calls that ended.",
        labels=["tool", "effect", "status"],
    )
    for labels in sorted(buckets):
        counts = buckets[labels]
        ended.add_metric(list(labels), sum(counts))
        cumulative: list[tuple[str, float]] = []
        running = 0.0
        for bound, n in zip((*map(_le, LATENCY_BUCKETS), "+Inf"), counts, strict=True):
            running += n
            cumulative.append((bound, running))
        duration.add_metric(list(labels), cumulative, sums.get(labels, 0.0))
    yield ended
    yield duration


def _sweep_families(raw: dict[Any, Any], now: float) -> Iterator[Any]:
    stats: dict[str, dict[str, float]] = {}
    for field, value in raw.items():
        job, _, what = _text(field).rpartition(":")
        stats.setdefault(job, {})[what] = float(value)
    # Labelled "sweep": a label named "job" collides with Prometheus's own scrape label.
    runs = CounterMetricFamily("dex_sweep_runs", "Sweep job runs, by sweep.", labels=["sweep"])
    moved = CounterMetricFamily(
        "dex_sweep_moved", "Calls a sweep job acted on (reaped, republished, expired).",
        labels=["sweep"],
    )
    last = GaugeMetricFamily(
        "dex_sweep_last_run_timestamp_seconds", "When each sweep job last ran (epoch).",
        labels=["sweep"],
    )
    for job, values in sorted(stats.items()):
        runs.add_metric([job], values.get("runs", 0.0))
        moved.add_metric([job], values.get("moved", 0.0))
        if "last_run" in values:
            last.add_metric([job], values["last_run"])
    yield runs
    yield moved
    yield last
    latest = [v["last_run"] for v in stats.values() if "last_run" in v]
    if latest:
        yield GaugeMetricFamily(
            "dex_beat_last_sweep_age_seconds",
            "Seconds since any sweep last ran; past 3 sweep intervals no beat is running.",
            value=max(0.0, now - max(latest)))


def metrics_redis(settings: DexSettings) -> redis.Redis:
    """One Redis client per Redis configuration per process for scrapes (short timeouts: a
    scrape must not hang on a dead Redis)."""
    return _metrics_redis(settings.model_dump_json(include=set(_REDIS_FIELDS)))


_REDIS_FIELDS = ("redis_url", "redis_sentinel_master", "redis_tls_ca_file",
                 "redis_tls_cert_file", "redis_tls_key_file")


def shown_runs(settings: DexSettings) -> Runs:
    """The running attempts of retrying calls (``broker/runs.py``) on the scrape client, for
    the readers that show calls (a snapshot, ``get_tool_call``, the session page)."""
    return _shown_runs(settings.model_dump_json(include=set(_REDIS_FIELDS)))


@functools.lru_cache(maxsize=4)
def _shown_runs(redis_settings: str) -> Runs:
    return Runs(_metrics_redis(redis_settings))


@functools.lru_cache(maxsize=4)
def _metrics_redis(redis_settings: str) -> redis.Redis:
    settings = DexSettings.model_validate_json(redis_settings)
    return redis_client(settings, socket_timeout=2, socket_connect_timeout=2)


def _le(bound: float) -> str:
    return repr(float(bound))


def render_metrics(store: Store, redis_client: redis.Redis | None = None, *,
                   now: float | None = None) -> tuple[bytes, str]:
    """The Prometheus text exposition of dex-tasks and its content type, computed now.

    Never raises for an unreachable store or Redis: the scrape says so in ``dex_store_up`` and
    ``dex_redis_up`` instead, which is what an alert wants to see.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, redis_client, now=now))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def beat_state(settings: DexSettings) -> Literal["ok", "late", "unknown"]:
    """``ok`` if a beat swept within 3 sweep intervals, ``late`` if none did (approval
    deadlines are not being enforced), ``unknown`` if Redis, where beat records its sweeps,
    does not answer. What ``/healthz``, the session page and ``dex-tasks status`` go by."""
    try:
        client = metrics_redis(settings)
        client.ping()
        last = last_sweep_at(client)
    except redis.RedisError as err:
        log.warning("beat's last sweep unreadable: Redis unreachable",
                    extra={"action": "http_beat_state_unknown", "error": str(err)})
        return "unknown"
    return "late" if beat_is_late(last, settings.sweep_interval_seconds) else "ok"
