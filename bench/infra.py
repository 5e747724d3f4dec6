"""What every benchmark needs: a private Redis, fresh stores, worker subprocesses, RSS,
percentiles, a description of the machine, and the results file.

Nothing here touches a shared server's data: Redis is a private ``redis-server`` on a free
port, SQLite stores live in a temporary folder, and PostgreSQL stores are fresh databases
(created from the admin URL, dropped afterwards).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

from dex_tasks.ops.procutil import children_of, free_port, wait_until
from dex_tasks.ops.procutil import redis_pings as _pings

if TYPE_CHECKING:
    from dex_tasks import DexClient

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
POSTGRES_ENV = "DEX_TEST_POSTGRES_URL"
STORES = ("sqlite", "postgres")

# The no-op tools of bench/noop_tools.py, named here so that the agent side of a benchmark need
# not import (and so register locally) the tool code.
READ_TOOL = "bench_noop_read"
SINGLE_ATTEMPT_TOOL = "bench_noop_write"
TOOLS_MODULE = "bench.noop_tools"
IO_TOOL = "bench_io_sleep"
IO_TOOLS_MODULE = "bench.io_tools"

T = TypeVar("T")


class BenchError(RuntimeError):
    """The benchmark could not run (a server did not start, a worker died, bad options)."""


def wait_for(predicate: Callable[[], T], timeout: float, what: str,
             interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; BenchError after ``timeout``."""
    return wait_until(predicate, timeout, what, interval, error=BenchError)


# -- Redis --------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A private ``redis-server`` on a free port, stopped by its PID; no persistence unless
    ``aof`` (``--appendonly yes``, fsync every second: what DESIGN's workload runs on)."""

    port: int = field(default_factory=free_port)
    aof: bool = False
    proc: subprocess.Popen[bytes] | None = None
    dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="dex-bench-redis-"))

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise BenchError("redis-server is not on PATH")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.aof else "no", "--dir", self.dir, "--databases", "16"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = self.client()
        wait_for(lambda: _pings(client), 10, f"redis-server on port {self.port}")
        client.close()
        return self

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, socket_connect_timeout=1)

    def version(self) -> str:
        client = self.client()
        try:
            return str(client.info("server").get("redis_version", "?"))
        finally:
            client.close()

    def commandstats(self) -> dict[str, int]:
        """Calls per Redis command since start (``INFO commandstats``)."""
        client = self.client()
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}

    def set_aof(self, on: bool, timeout: float = 60.0) -> None:
        """Turn the append-only file on or off at run time; on, wait for its first rewrite."""
        client = self.client()
        try:
            client.config_set("appendonly", "yes" if on else "no")

            def settled() -> bool:
                info = client.info("persistence")
                return (int(info["aof_enabled"]) == int(on)
                        and not int(info["aof_rewrite_in_progress"])
                        and not int(info.get("aof_rewrite_scheduled", 0)))

            wait_for(settled, timeout, f"redis appendonly {'on' if on else 'off'}")
        finally:
            client.close()
        self.aof = on

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


# -- stores -------------------------------------------------------------------------------------


def postgres_admin_url(explicit: str | None) -> str | None:
    """The admin URL fresh PostgreSQL databases are created from (option, else environment)."""
    return explicit or os.environ.get(POSTGRES_ENV) or None


def parse_stores(value: str) -> list[str]:
    """``sqlite``, ``postgres`` or ``both`` (or a comma list) as a list of store kinds."""
    if value == "both":
        return list(STORES)
    kinds = [v.strip() for v in value.split(",") if v.strip()]
    bad = [k for k in kinds if k not in STORES]
    if bad or not kinds:
        raise BenchError(f"--store must be sqlite, postgres or both, got {value!r}")
    return kinds


@contextmanager
def fresh_store(kind: str, postgres_url: str | None, workdir: Path) -> Iterator[str]:
    """A database URL for an empty store of ``kind``; the database is dropped afterwards."""
    if kind == "sqlite":
        path = workdir / f"dex-{uuid.uuid4().hex[:8]}.db"
        yield f"sqlite:///{path}"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    if not postgres_url:
        raise BenchError(f"the postgres store needs --postgres-url or ${POSTGRES_ENV}")
    name = f"dex_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    finally:
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            admin.dispose()


def postgres_version(url: str | None) -> str | None:
    if not url:
        return None
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return str(conn.execute(text("SHOW server_version")).scalar())
    except Exception:  # noqa: BLE001 - only a label for the results file
        return None
    finally:
        engine.dispose()


# -- worker processes ---------------------------------------------------------------------------


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any ``DEX_*`` setting, plus ``extra``; the repo on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class WorkerProcess:
    """A worker subprocess (its own session, so its children are stopped with it)."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, name: str, args: Sequence[str], env: dict[str, str],
              log_path: Path) -> WorkerProcess:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(list(args), cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return cls(name, proc, log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(f"the {self.name} worker exited ({self.proc.returncode}):\n"
                             f"{self.log_tail()}")

    def children(self) -> list[int]:
        return children_of(self.pid)

    def wait_children(self, count: int, timeout: float = 60.0) -> list[int]:
        def ready() -> list[int]:
            self.check_alive()
            kids = self.children()
            return kids if len(kids) >= count else []

        return wait_for(ready, timeout, f"{count} children of the {self.name} worker")

    def rss_bytes(self) -> tuple[int, dict[int, int]]:
        """Resident memory of the main process plus its children: (total, per pid)."""
        per_pid = {pid: rss_bytes(pid) for pid in [self.pid, *self.children()]}
        return sum(per_pid.values()), per_pid

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL of the whole process group if it lingers."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)


def rss_bytes(pid: int) -> int:
    """``VmRSS`` of ``pid`` in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- figures ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct``-th percentile (linear interpolation between closest ranks)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(redis_server: RedisServer | None = None,
                 postgres_url: str | None = None) -> dict[str, Any]:
    """What the figures were measured on; the load average says how shared the machine was."""
    return {
        "nproc": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("celery", "kombu", "redis", "sqlalchemy",
                                              "psycopg", "dex-tasks")},
        "redis_server": redis_server.version() if redis_server else None,
        "postgres_server": postgres_version(postgres_url),
    }


def write_results(kind: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``payload`` as ``<out_dir>/<kind>-<UTC timestamp>.json``; returns the path."""
    out = out_dir or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC)
    path = out / f"{kind}-{stamp.strftime('%Y%m%dT%H%M%SZ')}-{uuid.uuid4().hex[:4]}.json"
    body = {"kind": kind, "timestamp": stamp.isoformat(timespec="seconds"), **payload}
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")
    return path


def save_results(kind: str, payload: dict[str, Any], out_dir: Path | None,
                 console: Any) -> dict[str, Any]:
    """Write the results file, say where it is, and return ``payload`` with its ``path``."""
    path = write_results(kind, payload, out_dir)
    console.print(f"results: {path}")
    payload["path"] = str(path)
    return payload


# -- what every benchmark run shares -----------------------------------------------------------


@contextmanager
def bench_session(prefix: str, stores: Sequence[str],
                  postgres_url: str | None) -> Iterator[tuple[RedisServer, dict[str, Any], Path]]:
    """A private Redis, the description of the machine, and a scratch folder for one run;
    all removed afterwards. Yields ``(redis_server, machine, workdir)``."""
    redis_server = RedisServer().start()
    workdir = Path(tempfile.mkdtemp(prefix=f"dex-bench-{prefix}-"))
    try:
        machine = machine_info(redis_server, postgres_url if "postgres" in stores else None)
        yield redis_server, machine, workdir
        machine["loadavg_after"] = list(os.getloadavg())
    finally:
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def wait_for_catalog(client: DexClient, tool: str, check_alive: Callable[[], None]) -> None:
    """Wait until a worker has published ``tool`` to the catalog (it creates the tables
    first, so the client never races it to create them)."""

    def published() -> bool:
        check_alive()
        try:
            return client.store.get_catalog(tool) is not None
        except Exception:  # noqa: BLE001 - the tables may not exist yet
            return False

    wait_for(published, 60, "the dex-tasks worker to publish its catalog")


class RoundOf(Protocol):
    """A variant's measurements in one round of one store."""

    store: str
    variant: str
    round: int


R = TypeVar("R", bound=RoundOf)


def by_variant(results: Sequence[R], variants: Sequence[str],
               baseline: str) -> Iterator[tuple[str, str, list[R], list[R]]]:
    """Per store and variant (in that order): its rounds, and the baseline variant's rounds of
    the same numbers (for ratios taken round by round)."""
    by = {(r.store, r.variant, r.round): r for r in results}
    for store in dict.fromkeys(r.store for r in results):
        for variant in variants:
            runs = [r for r in results if r.store == store and r.variant == variant]
            if runs:
                yield store, variant, runs, [by[(store, baseline, r.round)] for r in runs]


# -- pg_stat_statements -------------------------------------------------------------------------


def statement_stats(engine: Engine) -> list[dict[str, Any]]:
    """pg_stat_statements' rows for the statements on the store's tables in ``engine``'s
    database (EXPLAIN, the statistics' own and schema statements left out)."""
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT query, calls, total_exec_time, rows, shared_blks_hit, shared_blks_read, "
            "shared_blks_dirtied, wal_bytes FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = current_database() "
            "AND query ~* 'dex_(tool_calls|call_events|messages)' "
            "AND query !~* '^(EXPLAIN|SELECT pg_stat|DROP|CREATE|TRUNCATE|ALTER)'"
        )).mappings().all()
    return [dict(r) for r in rows]


def reset_statement_stats(engine: Engine) -> None:
    """Start pg_stat_statements' counts again."""
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_statements_reset()"))
