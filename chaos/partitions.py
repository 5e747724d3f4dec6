"""Network partitions: workers, beat and an agent as hosts in network namespaces (root only).

``python -m chaos.partitions`` runs the scenarios of issue 19 (``--scenario P1 ...`` picks some)
with the production defaults (30 s leases, 10 s sweeps, the 300 s republish window) and prints,
per scenario, the calls, the duplicates, the longest time from the fault (or the heal) to a
call's end, and the longest stretch during the fault in which no call ended anywhere. It exits
1 when a guarantee broke or a recovery bound was missed. ``tests/test_partitions.py`` runs P1
and P2 with shorter leases in ``make test``.

The hosts reach Redis and PostgreSQL on the infrastructure host (``tests/netns.py``); a cut is
a silent two-way drop of every packet between a host and a service. Each scenario checks:

* no single-attempt call ran twice (the ledger every tool writes before it acts);
* every call ended, with exactly one tool message in its session's transcript;
* every call ended within ``bound`` seconds of the fault (or of the heal);
* for a host lost for good: the longest gap in which no call ended anywhere (the others kept
  serving).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, func, select, text

from dex_tasks import DexClient, DexSettings
from dex_tasks.broker import routing
from dex_tasks.broker.metrics import shown_runs
from dex_tasks.ops.procutil import dex_command, wait_until
from dex_tasks.states import TERMINAL, CallStatus
from dex_tasks.store import CALLS, MESSAGES
from dex_tasks.store.delivery import DELIVERY_LOCK_SPACE
from tests.netns import Host, Network
from workers import ledger

SINGLE_ATTEMPT_TOOLS = {"charge_card"}
TERMINAL_VALUES = [s.value for s in TERMINAL]


@dataclass
class Result:
    """The figures of one scenario, and what went wrong (``problems`` empty when it held)."""

    scenario: str
    calls: int = 0
    duplicates: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    longest_to_terminal: float = 0.0
    longest_gap: float = 0.0
    served_again_after: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        extra = " ".join(f"{k}={v:g}" for k, v in self.extra.items())
        return (f"{self.scenario}: calls={self.calls} duplicates={self.duplicates} "
                f"longest_to_terminal={self.longest_to_terminal:.1f}s "
                f"longest_gap={self.longest_gap:.1f}s "
                f"served_again_after={self.served_again_after:.1f}s {extra} "
                f"{'OK' if not self.problems else 'FAILED: ' + '; '.join(self.problems)}")


@dataclass
class Timing:
    """The settings a scenario runs with: production's by default, shorter in ``make test``."""

    lease_seconds: float = 30.0
    sweep_interval_seconds: float = 10.0
    # A message a worker's BRPOP had taken off its queue when a cut hit that worker never
    # arrives, and kombu records a message as held only once it arrives: only the republisher
    # finds such a call, after this window (see docs/recovery.md).
    republish_after_seconds: float = 30.0
    bound: float = 60.0
    # Any other settings (DEX_* field names), e.g. to run a scenario without a bound.
    settings: dict[str, object] = field(default_factory=dict)

    def overrides(self) -> dict[str, object]:
        return {"lease_seconds": self.lease_seconds,
                "sweep_interval_seconds": self.sweep_interval_seconds,
                "republish_after_seconds": self.republish_after_seconds, **self.settings}


class Lab:
    """One scenario's world: the network, a fresh database, the hosts' settings, the load."""

    def __init__(self, workdir: Path, postgres_url: str, timing: Timing) -> None:
        self.workdir = workdir
        self.timing = timing
        self.net = Network()
        self.db_name = f"dex_part_{uuid.uuid4().hex[:10]}"
        self.admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.db_name}"'))
        base = postgres_url.rpartition("/")[0]
        self.local_db = f"{base}/{self.db_name}"
        pg = self.admin.url
        hosts_redis = self.net.start_redis()
        self.local_redis = f"redis://127.0.0.1:{self.net.port('redis')}/0"
        infra, port = self.net.forward("store", (pg.host or "127.0.0.1", pg.port or 5432))
        user = f"{pg.username}@" if pg.username else ""
        self.hosts_db = f"postgresql+psycopg://{user}{infra}:{port}/{self.db_name}"
        self.ledger = workdir / "ledger.jsonl"
        common = {"secret_key": "partition-test-key", "state_dir": str(workdir / "state"),
                  **timing.overrides()}
        self.local = DexSettings(redis_url=self.local_redis, database_url=self.local_db,
                                 **common)  # type: ignore[arg-type]
        self.hosts_settings = DexSettings(redis_url=f"{hosts_redis}/0",
                                          database_url=self.hosts_db,
                                          **common)  # type: ignore[arg-type]
        self.client = DexClient(self.local)
        self.keys: list[str] = []
        self.keys_lock = threading.Lock()
        self.sessions: list[str] = []
        self.engines: list[Any] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
        for name, value in self.hosts_settings.model_dump().items():
            if value is None:
                continue
            if hasattr(value, "get_secret_value"):
                value = value.get_secret_value()
            env[f"DEX_{name.upper()}"] = str(value)
        env.update({"DEX_EXAMPLE_LEDGER": str(self.ledger), "PYTHONUNBUFFERED": "1", **extra})
        return env

    def worker(self, name: str, concurrency: int = 2) -> Host:
        return self.workers(name, concurrency=concurrency)[0]

    def workers(self, *names: str, concurrency: int = 2) -> list[Host]:
        """Worker hosts, started together; returns once every one is ready."""
        hosts = [self.net.add_host(name) for name in names]
        for host in hosts:
            host.run([*dex_command(), "worker", "--tools", "workers.example_tools", "-c",
                      str(concurrency), "-l", "INFO"],
                     self.env(), self.workdir / f"{host.name}.log")
        for name in names:
            self.wait_ready(name)
        return hosts

    def wait_ready(self, name: str) -> None:
        wait_until(lambda: " ready." in self.log(name), 60, f"worker {name} to be ready", 0.1)

    def beat(self) -> Host:
        host = self.net.add_host("beat")
        host.run([*dex_command(), "beat"], self.env(), self.workdir / "beat.log")
        wait_until(lambda: "beat: Starting" in self.log("beat"), 60, "beat to start", 0.1)
        return host

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- the load -------------------------------------------------------------------------------

    def call(self, session: str, tool: str, **arguments: Any) -> str:
        record = self.client.call_tool(session_id=session, turn_id="t",
                                       tool_call_id=uuid.uuid4().hex, tool=tool,
                                       arguments=arguments)
        with self.keys_lock:
            self.keys.append(record.key)
        return record.key

    @contextmanager
    def load(self, rate: float = 4.0, sessions: int = 4) -> Iterator[None]:
        """Calls at ``rate`` per second, mixed single-attempt and retrying, in a thread."""
        stop = threading.Event()
        names = [f"s{i}-{uuid.uuid4().hex[:6]}" for i in range(sessions)]
        self.sessions = names

        def run() -> None:
            n = 0
            while not stop.wait(1.0 / rate):
                session = names[n % sessions]
                if n % 2:
                    self.call(session, "charge_card", customer_id=f"c{n}", amount_cents=n,
                              sleep=0.3)
                else:
                    self.call(session, "lookup_order", order_id="1001", sleep=0.3)
                n += 1

        thread = threading.Thread(target=run, name="partition-load", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(30)

    # -- the verdict ----------------------------------------------------------------------------

    def rows(self) -> list[Any]:
        with self.client.store.read() as conn:
            return list(conn.execute(select(CALLS.c.key, CALLS.c.tool, CALLS.c.status,
                                            CALLS.c.created_at, CALLS.c.finished_at,
                                            CALLS.c.error)
                                     .where(CALLS.c.key.in_(self.keys))))

    lost_locks_gone: float = float("nan")

    def watch_backend(self, engine: Any, pid: int, timeout: float = 120.0) -> None:
        """Note when the server session ``pid`` (the lost host's) holds no lock any more: it
        ended, or its write committed and left it idle outside any transaction.

        A move that is one statement in autocommit (PostgreSQL's terminal move) commits as soon
        as the lock it waits for is free, whether or not its answer can reach the lost host;
        a move inside a transaction holds its locks until the server ends the session
        (``DEX_STORE_IDLE_IN_TRANSACTION_SECONDS``)."""
        deadline = time.time() + timeout
        try:
            with engine.connect() as conn:
                while time.time() < deadline:
                    held = conn.execute(text("SELECT count(*) FROM pg_locks WHERE pid = :pid "
                                             "AND granted"), {"pid": pid}).scalar_one()
                    conn.commit()
                    if not held:
                        self.lost_locks_gone = time.time()
                        return
                    time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the lab is closing: the locks were never released
            return

    def why_open(self, key: str) -> str:
        """What Redis and the store say of a call that did not end (for the report)."""
        import redis as redis_lib

        from dex_tasks.worker import claims

        client = redis_lib.Redis.from_url(self.local_redis)
        try:
            claim = claims.read_claim(client, key)
            unacked = sum(1 for v in client.hvals("unacked") if key.encode() in v)
            call = self.client.store.get_call(key)
            queue = routing.queue_for(call.tool) if call else "?"
            queued = sum(1 for m in client.lrange(queue, 0, -1) if key.encode() in m)
        finally:
            client.close()
        call = self.client.store.get_call(key)
        published = call.published_at if call else None
        return (f"[claim={claim} unacked={unacked} in_queue={queued} published_at={published} "
                f"republishes={call.republishes if call else None}]")

    def settle(self, timeout: float) -> None:
        def done() -> bool:
            return all(r.status in TERMINAL_VALUES for r in self.rows())

        try:
            wait_until(done, timeout, "every call to end", 0.25)
        except AssertionError:
            pass  # the verdict names the calls that did not end

    def verdict(self, scenario: str, since: float, *, gap_from: float | None = None,
                gap_to: float | None = None) -> Result:
        """The checks of the module's doc; ``since``: the fault (or heal) the bound counts
        from; the gap is measured between ``gap_from`` and ``gap_to`` (None: not measured)."""
        rows = self.rows()
        result = Result(scenario, calls=len(rows),
                        statuses=dict(Counter(str(r.status) for r in rows)))
        runs = Counter(e["key"] for e in ledger.read(self.ledger))
        tools = {r.key: r.tool for r in rows}
        result.duplicates = sum(1 for k, n in runs.items()
                                if n > 1 and tools.get(k) in SINGLE_ATTEMPT_TOOLS)
        if result.duplicates:
            result.problems.append(f"{result.duplicates} single-attempt calls ran twice")
        open_calls = [r for r in rows if r.status not in TERMINAL_VALUES]
        if open_calls:
            some = ", ".join(f"{r.tool} {r.status} {r.key[:40]} {self.why_open(r.key)}"
                             for r in open_calls[:3])
            result.problems.append(f"{len(open_calls)} calls never ended ({some})")
        with self.client.store.read() as conn:
            messages: dict[str, int] = dict(conn.execute(
                select(MESSAGES.c.key, func.count()).where(MESSAGES.c.key.in_(self.keys))
                .group_by(MESSAGES.c.key)).all())
        wrong = [r.key for r in rows if r.status in TERMINAL_VALUES and messages.get(r.key) != 1]
        if wrong:
            result.problems.append(f"{len(wrong)} ended calls without exactly one tool message")
        ends = sorted(float(r.finished_at) for r in rows if r.finished_at is not None)
        late = [end - max(since, float(r.created_at)) for r in rows
                if r.finished_at is not None for end in [float(r.finished_at)]]
        result.longest_to_terminal = round(max([0.0, *late]), 1)
        if result.longest_to_terminal > self.timing.bound:
            result.problems.append(f"a call took {result.longest_to_terminal:.1f}s to end after "
                                   f"the fault (bound {self.timing.bound:g}s)")
        if gap_from is not None and gap_to is not None:
            inside = [e for e in ends if gap_from <= e <= gap_to]
            points = [gap_from, *inside, gap_to]
            result.longest_gap = round(max(b - a for a, b in itertools.pairwise(points)), 1)
            result.served_again_after = round((inside[0] - gap_from) if inside else
                                              gap_to - gap_from, 1)
        return result

    def close(self) -> None:
        try:
            self.client.close()
            for engine in self.engines:
                engine.dispose()
        finally:
            self.net.close()
            with self.admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
            self.admin.dispose()


# -- the scenarios ------------------------------------------------------------------------------


def lost_in_transaction(lab: Lab, *, load_after: float = 30.0) -> Result:
    """P1: a worker host lost while its PostgreSQL session is inside a terminal transaction
    (holding the call's row lock and its session's delivery lock), then a second worker
    SIGKILLed. The others must keep finishing calls, the lost session's locks must go, and
    every call must end within the bound."""
    hosts = lab.workers("w1", "w2", "w3")
    lab.beat()
    with lab.load(sessions=4):
        time.sleep(3)
        # One of the load's sessions: its other calls queue behind the lost session's lock.
        blocked = lab.sessions[0]
        # Hold the blocked session's delivery lock, so the worker that ends its call stops
        # inside the terminal transaction, after the UPDATE took the row lock.
        engine = create_engine(lab.local_db)
        lab.engines.append(engine)
        with engine.connect() as holder:
            holder.execute(select(func.pg_advisory_xact_lock(DELIVERY_LOCK_SPACE,
                                                             func.hashtext(blocked))))
            key = lab.call(blocked, "update_address", order_id="1001", address="x")
            backend = wait_until(lambda: _waiting_on_advisory(holder), 30,
                                 "a worker to wait inside its terminal transaction", 0.05)
            owner = lab.client.store.get_call(key)
            worker = str(owner.worker if owner and owner.worker else "")
            if not worker:
                # A retrying call runs leased in Redis, its owner there (DESIGN v4).
                run = shown_runs(lab.client.settings).get(key)
                worker = run.worker if run else ""
            lost = next(h for h in hosts if any(f"dex-{p.pid}@" in worker for p in h.procs))
            fault = lost.cut()
            holder.commit()  # the lost worker's statement goes on, its answer into the void
            watcher = threading.Thread(target=lab.watch_backend, args=(engine, backend),
                                       daemon=True)
            watcher.start()
        others = [h for h in hosts if h is not lost]
        time.sleep(2)
        others[0].kill()  # a second worker, SIGKILLed
        time.sleep(load_after)
        load_end = time.time()
    lab.settle(lab.timing.bound + 30)
    watcher.join(1)
    result = lab.verdict("P1 host lost inside a transaction", fault, gap_from=fault,
                         gap_to=load_end)
    result.extra["lost_locks_gone_after"] = lab.lost_locks_gone - fault
    _bound_gap(lab, result)
    return result


def _waiting_on_advisory(holder: Any) -> int | None:
    """The server pid of a session waiting on an advisory lock (the blocked worker's)."""
    pid = holder.execute(text(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND wait_event = 'advisory' AND pid <> pg_backend_pid() LIMIT 1")).scalar()
    return int(pid) if pid is not None else None


def _bound_gap(lab: Lab, result: Result) -> None:
    # The lost session's locks go within the idle-in-transaction bound; a few seconds more for
    # the calls that waited on them to commit, and for the load's spacing.
    limit = lab.hosts_settings.store_idle_in_transaction_seconds + 10
    if result.longest_gap > limit:
        result.problems.append(f"no call ended anywhere for {result.longest_gap:.1f}s "
                               f"(bound {limit:g}s)")


def redis_cut_then_healed(lab: Lab, *, cut_for: float = 45.0, after: float = 10.0) -> Result:
    """P2: a worker cut from Redis, then healed: the calls sent meanwhile (and after) must run
    as soon as it is back, none left for the republisher's 300 s window."""
    worker = lab.worker("w1")
    lab.beat()
    # Warm every child's Redis claim connection, so each sits idle in the pool when cut.
    for i in range(4):
        lab.call("warm", "charge_card", customer_id=f"w{i}", amount_cents=1)
    lab.settle(30)
    worker.cut("redis")
    with lab.load(rate=2.0, sessions=2):
        time.sleep(cut_for)
        heal = worker.heal()
        time.sleep(after)
    lab.settle(lab.timing.bound + 30)
    result = lab.verdict("P2 worker cut from Redis, healed", heal)
    claim_errors = lab.log("w1").count("claim_failed")
    result.extra["claims_lost"] = claim_errors
    return result


def store_cut_then_healed(lab: Lab, *, cut_for: float = 45.0) -> Result:
    """P3: a worker cut from the store, then healed: it must say so within seconds (not
    after the heal), and every call must end within the bound."""
    worker, _ = lab.workers("w1", "w2")
    lab.beat()
    with lab.load(rate=3.0, sessions=4):
        time.sleep(3)
        fault = worker.cut("store")
        said = _first_log_after(lab, "w1", ("store_retry", "lease_renew_error", "failed"),
                                fault, cut_for)
        time.sleep(max(0.0, fault + cut_for - time.time()))
        heal = worker.heal()
        time.sleep(10)
    lab.settle(lab.timing.bound + 30)
    result = lab.verdict("P3 worker cut from the store, healed", fault)
    result.extra["first_log_after_cut"] = round(said - fault, 1) if said else -1.0
    result.extra["healed_at"] = round(heal - fault, 1)
    if not said or said - fault > 20:
        result.problems.append("the cut worker logged nothing within 20 s of the cut")
    return result


def _first_log_after(lab: Lab, name: str, words: tuple[str, ...], since: float,
                     timeout: float) -> float | None:
    size = len(lab.log(name))
    deadline = since + timeout
    while time.time() < deadline:
        fresh = lab.log(name)[size:]
        if any(w in fresh for w in words):
            return time.time()
        time.sleep(0.25)
    return None


AGENT_SCRIPT = """
import json, sys, time, uuid
from dex_tasks import DexClient
with DexClient() as client:
    client.call_tool(session_id="agent", turn_id="t", tool_call_id="warm", tool="lookup_order",
                     arguments={"order_id": "1001"})
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(4):
        started = time.monotonic()
        record = client.call_tool(session_id="agent", turn_id="t", tool_call_id=uuid.uuid4().hex,
                                  tool="lookup_order", arguments={"order_id": "1001"})
        print(json.dumps({"seconds": time.monotonic() - started, "status": record.status.value}),
              flush=True)
"""


def agent_cut_from_redis(lab: Lab) -> Result:
    """P4: the agent host cut from Redis: ``call_tool`` must give up within
    ``DEX_PUBLISH_TIMEOUT_SECONDS`` (plus a second), ending the call "did not run"."""
    import subprocess

    lab.worker("w1")
    host = lab.net.add_host("agent")
    script = lab.workdir / "agent.py"
    script.write_text(AGENT_SCRIPT)
    proc = subprocess.Popen(["ip", "netns", "exec", host.namespace, sys.executable, str(script)],
                            env=lab.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=Path.cwd())
    host.procs.append(proc)  # type: ignore[arg-type]
    assert proc.stdin is not None and proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        return Result("P4 agent cut from Redis", problems=["the agent did not start"])
    fault = host.cut("redis")
    proc.stdin.write("go\n")
    proc.stdin.flush()
    timings = [json.loads(proc.stdout.readline()) for _ in range(4)]
    proc.wait(30)
    result = Result("P4 agent cut from Redis", calls=len(timings))
    worst = max(t["seconds"] for t in timings)
    result.longest_to_terminal = round(worst, 1)
    result.extra = {"first_call": round(timings[0]["seconds"], 2),
                    "later_calls": round(max(t["seconds"] for t in timings[1:]), 2)}
    limit = lab.hosts_settings.publish_timeout_seconds + 1.0
    if worst > limit:
        result.problems.append(f"call_tool blocked {worst:.1f}s (bound {limit:g}s)")
    if any(t["status"] != CallStatus.FAILED.value for t in timings):
        result.problems.append("a call whose publish failed did not end 'did not run'")
    del fault
    return result


def beat_cut_then_healed(lab: Lab, *, cut_for: float = 60.0) -> Result:
    """P5: beat cut from everything for a while, during which a worker dies: after the heal,
    its calls are reaped within a sweep interval and a lease, not half a minute later."""
    worker, _ = lab.workers("w1", "w2")
    beat = lab.beat()
    with lab.load(rate=3.0, sessions=4):
        time.sleep(5)
        fault = beat.cut()
        time.sleep(2)
        worker.kill()
        time.sleep(cut_for)
        heal = beat.heal()
        time.sleep(5)
    lab.settle(lab.timing.bound + 30)
    result = lab.verdict("P5 beat cut, healed", heal)
    del fault
    return result


SCENARIOS: dict[str, Callable[[Lab], Result]] = {
    "P1": lost_in_transaction,
    "P2": redis_cut_then_healed,
    "P3": store_cut_then_healed,
    "P4": agent_cut_from_redis,
    "P5": beat_cut_then_healed,
}


def run_scenario(name: str, workdir: Path, postgres_url: str,
                 timing: Timing | None = None, **options: Any) -> Result:
    """Build a lab in ``workdir``, run scenario ``name`` in it, tear everything down."""
    workdir.mkdir(parents=True, exist_ok=True)
    lab = Lab(workdir, postgres_url, timing or Timing())
    try:
        return SCENARIOS[name](lab, **options)  # type: ignore[call-arg]
    finally:
        lab.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.partitions", description=__doc__)
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                   help="scenarios to run (default: all)")
    p.add_argument("--database-url", default=os.environ.get("DEX_TEST_POSTGRES_URL"),
                   help="a PostgreSQL server URL (default: $DEX_TEST_POSTGRES_URL)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/dex-partitions"))
    p.add_argument("--json", type=Path, dest="json_path")
    a = p.parse_args(argv)
    if not a.database_url:
        p.error("--database-url (or DEX_TEST_POSTGRES_URL) is required")
    results = []
    for name in a.scenario or sorted(SCENARIOS):
        result = run_scenario(name, a.workdir / name, a.database_url)
        print(result.line(), flush=True)
        results.append(result)
    if a.json_path:
        a.json_path.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
