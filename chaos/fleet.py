"""The fleet, measured: worker hosts in network namespaces around one PgBouncer, one PostgreSQL
with a small ``max_connections`` and one Redis behind Sentinel (root only).

``python -m chaos.fleet`` builds the fleet as an operator would (``docs/deploying.md``): worker
processes on the threads pool with an I/O tool, spread over hosts (network namespaces, as the
partition scenarios build them), each store connection through PgBouncer in transaction mode
(``DEX_STORE_POOLER=transaction``) to a private PostgreSQL with ``max_connections = 40``, Redis
through Sentinel (a master, a replica, three Sentinels, AOF on), and one beat. Then, each part
printed as it ends and written to ``chaos/results/fleet-*.json``:

* **the curve**: for 1, 5, 10, 20 and 40 worker processes, the calls/s a closed-loop producer
  gets (a backlog kept at the fleet's slots), the store commits and Redis commands per call,
  and the server connections PgBouncer holds;
* **a Sentinel failover** in the middle of that load (``--failover``): the master SIGKILLed,
  then the time until calls end again and until every call sent before the kill has ended;
  the run fails on a duplicate (a single-attempt call run twice: the ledger) or a call that
  never ends;
* **a soak** (``--soak-minutes``, in ``make chaos`` only): a steady rate for that long, sampled
  every ``--sample-seconds``: the RSS of every process, PostgreSQL's connections, Redis's keys
  and memory, and the store's rows per call. Each series is reported with its growth per hour
  after the first samples: once calls end, nothing should grow with them.

It exits 1 when a guarantee broke (a duplicate, a call left unended, a recovery over its bound).
``tests/test_fleet.py`` runs a small fleet (two hosts, a failover) in ``make test``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from dex_tasks import DexClient, DexSettings
from dex_tasks.broker import routing
from dex_tasks.ops.procutil import children_of, dex_command, wait_until
from dex_tasks.states import TERMINAL, TOOL_DID_NOT_RUN
from tests.netns import Host, Network
from tests.pgbouncer import PgBouncer
from tests.postgres_server import PostgresServer
from tests.redis_ha import MASTER_NAME, SentinelGroup, start_sentinel_group
from workers import ledger

RESULTS = Path(__file__).resolve().parent / "results"
TOOLS = "chaos.fleet_tools"
READ, WRITE = "fleet_lookup", "fleet_charge"
TERMINAL_VALUES = tuple(s.value for s in TERMINAL)
DATABASE = "dex"


@dataclass
class Config:
    """How the fleet is built and loaded."""

    steps: list[int] = field(default_factory=lambda: [1, 5, 10, 20, 40])
    hosts: int = 4
    threads: int = 20
    sleep: float = 0.05
    step_seconds: float = 20.0
    warmup_seconds: float = 5.0
    max_connections: int = 40
    pool_size: int = 30
    failover: bool = True
    failover_workers: int = 10
    recovery_bound: float = 60.0
    soak_minutes: float = 0.0
    soak_rate: float = 50.0
    soak_workers: int = 10
    sample_seconds: float = 30.0
    # The sweeps' timing: production's by default (30 s leases, 10 s sweeps).
    settings: dict[str, object] = field(default_factory=dict)


@dataclass
class Step:
    """One point of the curve."""

    workers: int
    calls: int
    seconds: float
    calls_per_s: float
    commits_per_call: float
    redis_commands_per_call: float
    server_connections: int
    client_connections: int
    load_average: float


@dataclass
class Failover:
    """What a Sentinel failover under load did."""

    workers: int
    calls: int
    first_end_after_kill: float
    all_sent_before_ended_after: float
    new_master_after: float


@dataclass
class Sample:
    """One soak sample."""

    minute: float
    ended: int
    rss_mb: dict[str, float]
    pg_connections: int
    redis_keys: int
    redis_used_mb: float
    rows_per_call: dict[str, float]


@dataclass
class Report:
    """Everything one run measured, and what broke."""

    steps: list[Step] = field(default_factory=list)
    failover: Failover | None = None
    soak: list[Sample] = field(default_factory=list)
    soak_growth_per_hour: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    duplicates: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


class Fleet:
    """The servers, the hosts and their processes, the producer; :meth:`close` removes all."""

    def __init__(self, workdir: Path, config: Config) -> None:
        self.workdir = workdir
        self.config = config
        self.net = Network()
        self.hosts: list[Host] = []
        self.workers: list[tuple[Host, Any]] = []
        self.engines: list[Engine] = []
        try:
            self._start(workdir, config)
        except BaseException:
            self.close()
            raise

    def _start(self, workdir: Path, config: Config) -> None:
        infra = self.net.infra
        self.pg = PostgresServer(settings={"max_connections": str(config.max_connections),
                                           "shared_buffers": "128MB"}).start()
        admin = create_engine(self.pg.url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{DATABASE}"'))
        admin.dispose()
        # Measured directly, beside the pooler (one of the server's connections).
        self.direct = create_engine(self.pg.url(DATABASE), isolation_level="AUTOCOMMIT",
                                    pool_size=1, max_overflow=0)
        self.engines.append(self.direct)
        self.bouncer = PgBouncer(server=f"127.0.0.1:{self.pg.port}", settings={
            "listen_addr": f"127.0.0.1,{infra}", "max_client_conn": "5000",
            "default_pool_size": str(config.pool_size),
            "max_db_connections": str(config.pool_size), "server_login_retry": "1",
        }).start()
        self.redis: SentinelGroup = start_sentinel_group(infra, ["--appendonly", "yes"])
        common: dict[str, object] = {
            "secret_key": "fleet-test-key", "state_dir": str(workdir / "state"),
            "store_pooler": "transaction", "redis_sentinel_master": MASTER_NAME,
            **config.settings}
        self.ledger = workdir / "ledger.jsonl"
        self.hosts_settings = DexSettings(
            redis_url=self.redis.url_at(infra),
            database_url=f"postgresql+psycopg://postgres@{infra}:{self.bouncer.port}/{DATABASE}",
            **common)  # type: ignore[arg-type]
        self.local = DexSettings(
            redis_url=self.redis.url,
            database_url=f"postgresql+psycopg://postgres@127.0.0.1:{self.bouncer.port}/"
                         f"{DATABASE}",
            **common)  # type: ignore[arg-type]
        self.client = DexClient(self.local)
        self.beat_host = self.net.add_host("beat")
        self.beat_host.run([*dex_command(), "beat", "-l", "WARNING"], self.env(),
                           workdir / "beat.log")
        self.hosts = [self.net.add_host(f"h{i}") for i in range(config.hosts)]
        self.keys: list[str] = []
        self.sent_at: dict[str, float] = {}
        self.lock = threading.Lock()

    # -- processes ------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
        for name, value in self.hosts_settings.model_dump().items():
            if value is None:
                continue
            if hasattr(value, "get_secret_value"):
                value = value.get_secret_value()
            env[f"DEX_{name.upper()}"] = str(value)
        env.update({"DEX_EXAMPLE_LEDGER": str(self.ledger), "PYTHONUNBUFFERED": "1"})
        return env

    def master(self) -> redis.Redis:
        port = self.redis.master_port()
        if port is None:
            raise RuntimeError("no Redis master the Sentinels agree on")
        return redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=2)

    def scale_to(self, count: int) -> None:
        """Start (or stop) worker processes until ``count`` run, spread over the hosts, and
        wait until Redis lists them all."""
        while len(self.workers) > count:
            host, proc = self.workers.pop()
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        while len(self.workers) < count:
            n = len(self.workers)
            host = self.hosts[n % len(self.hosts)]
            proc = host.run([*dex_command(), "worker", "--tools", TOOLS, "-P", "threads",
                             "-c", str(self.config.threads), "-l", "WARNING",
                             "-n", f"w{n}@%h", "--without-heartbeat"],
                            self.env(), self.workdir / f"worker-{n}.log")
            self.workers.append((host, proc))

        def listed() -> bool:
            for n, (_, proc) in enumerate(self.workers):
                if proc.poll() is not None:
                    log = (self.workdir / f"worker-{n}.log").read_text(errors="replace")
                    raise RuntimeError(f"worker {n} exited ({proc.returncode}):\n{log[-3000:]}")
            client = self.master()
            try:
                return len(routing.live_workers(client)) >= count
            finally:
                client.close()

        wait_until(listed, 120, f"{count} workers to announce themselves", 0.2)

    def pids(self) -> dict[str, list[int]]:
        """Every process of the fleet, by role."""
        workers = [pid for _, proc in self.workers for pid in (proc.pid, *children_of(proc.pid))]
        beat = [pid for proc in self.beat_host.procs for pid in (proc.pid, *children_of(proc.pid))]
        pg = [self.pg.proc.pid, *children_of(self.pg.proc.pid)] if self.pg.proc else []
        bouncer = [self.bouncer.proc.pid] if self.bouncer.proc else []
        redis_pids = [s.proc.pid for s in (self.redis.master, self.redis.replica) if s.proc]
        return {"workers": workers, "beat": beat, "postgres": pg, "pgbouncer": bouncer,
                "redis": redis_pids}

    # -- the load -------------------------------------------------------------------------------

    def send_turn(self, n: int, size: int = 10) -> None:
        """One turn of ``size`` parallel calls, half reads and half single-attempt writes."""
        session = f"fleet-{n % 50}"
        calls = [{"tool_call_id": f"c{i}", "tool": WRITE if i % 2 else READ,
                  "arguments": {"item": f"{n}-{i}", "sleep": self.config.sleep}}
                 for i in range(size)]
        records = self.client.call_tools(calls, session_id=session, turn_id=f"t{n}")
        now = time.time()
        with self.lock:
            for record in records:
                self.keys.append(record.key)
                self.sent_at[record.key] = now

    def ended(self) -> int:
        """Calls ended so far (read on the direct connection)."""
        with self.direct.connect() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM dex_tool_calls WHERE status = ANY(:ended)"),
                {"ended": list(TERMINAL_VALUES)}).scalar_one())

    @contextmanager
    def closed_loop(self, backlog: int) -> Iterator[threading.Event]:
        """Keep about ``backlog`` calls in flight, in a thread, until the block ends."""
        stop = threading.Event()
        counter = itertools.count(len(self.keys))

        def run() -> None:
            ended = self.ended()
            while not stop.is_set():
                if len(self.keys) - ended < backlog:
                    try:
                        self.send_turn(next(counter))
                    except Exception as err:  # noqa: BLE001 - a failover: try again shortly
                        print(f"  send failed: {type(err).__name__}: {err}", flush=True)
                        stop.wait(0.5)
                    continue
                stop.wait(0.05)
                with suppress(Exception):
                    ended = self.ended()

        thread = threading.Thread(target=run, name="fleet-producer", daemon=True)
        thread.start()
        try:
            yield stop
        finally:
            stop.set()
            thread.join(60)

    @contextmanager
    def steady(self, rate: float) -> Iterator[None]:
        """Turns of ten calls at ``rate`` calls/s, in a thread, until the block ends."""
        stop = threading.Event()
        counter = itertools.count(len(self.keys))

        def run() -> None:
            due = time.monotonic()
            while not stop.is_set():
                due += 10 / rate
                with suppress(Exception):
                    self.send_turn(next(counter))
                stop.wait(max(0.0, due - time.monotonic()))

        thread = threading.Thread(target=run, name="fleet-steady", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(60)

    # -- figures --------------------------------------------------------------------------------

    def commits(self) -> int:
        with self.direct.connect() as conn:
            return int(conn.execute(text(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = :db"),
                {"db": DATABASE}).scalar_one())

    def redis_commands(self) -> int:
        client = self.master()
        try:
            return int(client.info("stats")["total_commands_processed"])
        finally:
            client.close()

    def pooler_connections(self) -> tuple[int, int]:
        """(server connections PgBouncer holds to the database, client connections it
        serves)."""
        with self.direct.connect() as conn:
            servers = int(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = :db "
                "AND pid <> pg_backend_pid()"), {"db": DATABASE}).scalar_one())
        return servers, self.bouncer_clients()

    def bouncer_clients(self) -> int:
        """Client connections PgBouncer serves for the database (its admin console)."""
        import psycopg

        try:
            with psycopg.connect(host="127.0.0.1", port=self.bouncer.port, dbname="pgbouncer",
                                 user="postgres", autocommit=True, prepare_threshold=None,
                                 connect_timeout=5) as conn:
                cursor = conn.execute("SHOW POOLS")
                names = [c.name for c in cursor.description or ()]
                pools = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        except Exception:  # noqa: BLE001 - only a figure
            return -1
        return sum(int(p["cl_active"]) + int(p["cl_waiting"]) for p in pools
                   if p["database"] == DATABASE)

    def rows_per_call(self) -> dict[str, float]:
        with self.direct.connect() as conn:
            counts = {table: int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
                      for table in ("dex_tool_calls", "dex_call_events", "dex_messages")}
        calls = max(1, counts["dex_tool_calls"])
        return {table: round(n / calls, 3) for table, n in counts.items()}

    def wait_all_ended(self, timeout: float) -> list[str]:
        """Wait until every call sent has ended; the keys still open after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            open_keys = self._open_keys()
            if not open_keys or time.monotonic() > deadline:
                return open_keys
            time.sleep(1.0)

    def _open_keys(self) -> list[str]:
        with self.direct.connect() as conn:
            return list(conn.execute(text(
                "SELECT key FROM dex_tool_calls WHERE NOT (status = ANY(:ended))"),
                {"ended": list(TERMINAL_VALUES)}).scalars())

    def close(self) -> None:
        with suppress(Exception):
            self.client.close()
        self.net.close()
        for engine in self.engines:
            engine.dispose()
        for name in ("redis", "bouncer", "pg"):  # what _start got to
            server = getattr(self, name, None)
            if server is not None:
                with suppress(Exception):
                    server.stop()


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return round(total / 1024, 1)


# -- the parts of a run -------------------------------------------------------------------------


def run_curve(fleet: Fleet, report: Report) -> None:
    config = fleet.config
    for count in config.steps:
        fleet.scale_to(count)
        with fleet.closed_loop(backlog=count * config.threads):
            time.sleep(config.warmup_seconds)
            ended0, commits0, cmds0 = fleet.ended(), fleet.commits(), fleet.redis_commands()
            started = time.monotonic()
            servers = clients = 0
            while time.monotonic() - started < config.step_seconds:
                time.sleep(min(2.0, config.step_seconds))
                s, c = fleet.pooler_connections()
                servers, clients = max(servers, s), max(clients, c)
            seconds = time.monotonic() - started
            ended1, commits1, cmds1 = fleet.ended(), fleet.commits(), fleet.redis_commands()
        calls = max(1, ended1 - ended0)
        step = Step(workers=count, calls=ended1 - ended0, seconds=round(seconds, 1),
                    calls_per_s=round((ended1 - ended0) / seconds, 1),
                    commits_per_call=round((commits1 - commits0) / calls, 2),
                    redis_commands_per_call=round((cmds1 - cmds0) / calls, 1),
                    server_connections=servers, client_connections=clients,
                    load_average=round(os.getloadavg()[0], 1))
        report.steps.append(step)
        print(f"  {count:3d} workers: {step.calls_per_s:7.1f} calls/s, "
              f"{step.commits_per_call:.2f} commits and {step.redis_commands_per_call:.1f} Redis "
              f"commands per call, {servers} server / {clients} client connections, "
              f"load {step.load_average}", flush=True)


def run_failover(fleet: Fleet, report: Report) -> None:
    config = fleet.config
    fleet.scale_to(config.failover_workers)
    with fleet.closed_loop(backlog=config.failover_workers * config.threads):
        time.sleep(config.warmup_seconds)
        old = fleet.redis.master_port()
        with fleet.lock:
            before = list(fleet.keys)
        killed = time.time()
        assert fleet.redis.master.proc is not None
        fleet.redis.master.proc.kill()
        new = wait_until(lambda: (p := fleet.redis.master_port()) not in (None, old) and p, 60,
                         "the Sentinels to promote the replica", 0.2)
        promoted = time.time() - killed
        first_end = float(wait_until(lambda: _first_end_after(fleet, killed),
                                     config.recovery_bound,
                                     "a call sent after the kill to end", 0.5) or 0.0)
        # One read of the open calls (a set built per key made this take minutes).
        still_open = set(fleet._open_keys())
        remaining = [k for k in before if k in still_open]
        deadline = killed + config.recovery_bound + 30
        while remaining and time.time() < deadline:
            time.sleep(1.0)
            still = set(fleet._open_keys())
            remaining = [k for k in remaining if k in still]
        all_before = time.time() - killed
    result = Failover(workers=config.failover_workers, calls=len(before),
                      first_end_after_kill=round(first_end - killed, 1),
                      all_sent_before_ended_after=round(all_before, 1),
                      new_master_after=round(promoted, 1))
    report.failover = result
    print(f"  failover: new master (port {new}) after {result.new_master_after}s, a call sent "
          f"after the kill ended {result.first_end_after_kill}s after it, every call sent "
          f"before it ended after {result.all_sent_before_ended_after}s"
          f"{'' if not remaining else f' ({len(remaining)} still open)'}", flush=True)
    if result.first_end_after_kill > config.recovery_bound:
        report.problems.append(f"calls ended again only {result.first_end_after_kill}s after "
                               f"the failover (bound {config.recovery_bound}s)")
    if remaining:
        report.problems.append(f"{len(remaining)} calls sent before the failover had not ended "
                               f"{config.recovery_bound + 30:g}s after it")


def _first_end_after(fleet: Fleet, moment: float) -> float | None:
    """When the first call made after ``moment`` succeeded (ran on a worker), if one has."""
    with fleet.direct.connect() as conn:
        value = conn.execute(text(
            "SELECT min(finished_at) FROM dex_tool_calls WHERE created_at > :t "
            "AND status = 'succeeded'"), {"t": moment}).scalar()
    return float(value) if value is not None else None


def run_soak(fleet: Fleet, report: Report) -> None:
    config = fleet.config
    fleet.scale_to(config.soak_workers)
    started = time.monotonic()
    with fleet.steady(config.soak_rate):
        while (elapsed := time.monotonic() - started) < config.soak_minutes * 60:
            time.sleep(min(config.sample_seconds, config.soak_minutes * 60 - elapsed))
            master = fleet.master()
            try:
                keys = int(master.dbsize())
                used = float(master.info("memory")["used_memory"]) / 2**20
            finally:
                master.close()
            sample = Sample(
                minute=round((time.monotonic() - started) / 60, 2), ended=fleet.ended(),
                rss_mb={role: rss_mb(pids) for role, pids in fleet.pids().items()},
                pg_connections=fleet.pooler_connections()[0], redis_keys=keys,
                redis_used_mb=round(used, 2), rows_per_call=fleet.rows_per_call())
            report.soak.append(sample)
            print(f"  soak {sample.minute:6.2f} min: {sample.ended} ended, RSS {sample.rss_mb}, "
                  f"{sample.pg_connections} server connections, {keys} Redis keys "
                  f"({sample.redis_used_mb} MB), rows per call {sample.rows_per_call}",
                  flush=True)
    report.soak_growth_per_hour = growth_per_hour(report.soak)
    print(f"  soak growth per hour after the first quarter: {report.soak_growth_per_hour}",
          flush=True)


def growth_per_hour(samples: list[Sample]) -> dict[str, float]:
    """Least-squares slope per hour of each series, over the samples after the first quarter
    (once imports, pools and caches have settled)."""
    kept = samples[len(samples) // 4:]
    if len(kept) < 2:
        return {}
    series: dict[str, list[tuple[float, float]]] = {}
    for s in kept:
        points = {"redis_keys": s.redis_keys, "redis_used_mb": s.redis_used_mb,
                  "pg_connections": s.pg_connections,
                  **{f"rss_mb.{role}": mb for role, mb in s.rss_mb.items()},
                  **{f"rows_per_call.{t}": v for t, v in s.rows_per_call.items()}}
        for name, value in points.items():
            series.setdefault(name, []).append((s.minute / 60, float(value)))
    return {name: round(_slope(points), 3) for name, points in series.items()}


def _slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def check_ledger(fleet: Fleet, report: Report, timeout: float) -> None:
    """Every call ended; no single-attempt call ran twice."""
    still_open = fleet.wait_all_ended(timeout)
    if still_open:
        report.problems.append(f"{len(still_open)} calls never ended, e.g. {still_open[:3]}")
    runs = Counter(entry["key"] for entry in ledger.read(fleet.ledger)
                   if entry["tool"] == WRITE)
    report.duplicates = sum(1 for n in runs.values() if n > 1)
    if report.duplicates:
        report.problems.append(f"{report.duplicates} single-attempt calls ran more than once")
    with fleet.direct.connect() as conn:
        report.statuses = {row[0]: int(row[1]) for row in conn.execute(text(
            "SELECT status, count(*) FROM dex_tool_calls GROUP BY status"))}
        failed = conn.execute(text(
            "SELECT key, tool, error FROM dex_tool_calls WHERE status = 'failed'")).all()
    report.calls = sum(report.statuses.values())
    # A call that failed never ran (the broker was unreachable at its publish): its error
    # says so, and the ledger agrees.
    dishonest = [key for key, tool, error in failed
                 if not (error or "").startswith(TOOL_DID_NOT_RUN) or runs.get(key)]
    if dishonest:
        report.problems.append(f"{len(dishonest)} failed calls do not say they did not run, "
                               f"or did run, e.g. {dishonest[:3]}")


def run(config: Config, workdir: Path | None = None) -> Report:
    """Build the fleet, run the parts ``config`` asks for, check, tear down."""
    report = Report()
    own = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="dex-fleet-"))
    fleet = Fleet(workdir, config)
    try:
        if config.steps:
            print("the curve:", flush=True)
            run_curve(fleet, report)
        if config.failover:
            print("a Sentinel failover under load:", flush=True)
            run_failover(fleet, report)
        if config.soak_minutes > 0:
            print(f"a soak at {config.soak_rate:g} calls/s for {config.soak_minutes:g} min:",
                  flush=True)
            run_soak(fleet, report)
        check_ledger(fleet, report, timeout=config.recovery_bound + 120)
    finally:
        fleet.close()
        if own:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="1,5,10,20,40",
                        help="worker processes at each point of the curve ('' for none)")
    parser.add_argument("--hosts", type=int, default=4, help="worker hosts (namespaces)")
    parser.add_argument("--threads", type=int, default=20, help="threads per worker")
    parser.add_argument("--sleep", type=float, default=0.05, help="each call's I/O, seconds")
    parser.add_argument("--step-seconds", type=float, default=20.0)
    parser.add_argument("--no-failover", action="store_true")
    parser.add_argument("--failover-workers", type=int, default=10)
    parser.add_argument("--soak-minutes", type=float, default=0.0)
    parser.add_argument("--soak-rate", type=float, default=50.0)
    parser.add_argument("--soak-workers", type=int, default=10)
    parser.add_argument("--sample-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    config = Config(steps=[int(s) for s in args.steps.split(",") if s.strip()],
                    hosts=args.hosts, threads=args.threads, sleep=args.sleep,
                    step_seconds=args.step_seconds, failover=not args.no_failover,
                    failover_workers=args.failover_workers, soak_minutes=args.soak_minutes,
                    soak_rate=args.soak_rate, soak_workers=args.soak_workers,
                    sample_seconds=args.sample_seconds)
    command = "python -m chaos.fleet " + " ".join(argv if argv is not None else sys.argv[1:])
    report = run(config)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"fleet-{stamp}-{uuid.uuid4().hex[:4]}.json"
    path.write_text(json.dumps({"command": command, "config": asdict(config),
                                "loadavg": os.getloadavg(), **asdict(report)}, indent=2) + "\n")
    print(f"{report.calls} calls {report.statuses}, {report.duplicates} duplicates; "
          f"results: {path}")
    for problem in report.problems:
        print(f"FAILED: {problem}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
