"""Fixtures: a private Redis server, a fresh store per test, and real worker processes."""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from dex_tasks import DexClient, DexSettings, StoreUnavailableError
from dex_tasks.store import Store
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import run_job
from tests.helpers import RedisServer, WorkerProcess, free_port, open_store, start_process
from tests.pgbouncer import PgBouncer, require_pgbouncer

POSTGRES_URL = os.environ.get("DEX_TEST_POSTGRES_URL", "")

# Offline: CrewAI (imported by its adapter's tests) would otherwise send OpenTelemetry traces to
# its telemetry host from a background thread, whose retries also draw on the `random` module
# while other tests' Hypothesis strategies run (a HypothesisDeprecationWarning, an error here).
# Set before any test imports crewai; worker and agent subprocesses inherit it.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for the whole run, so parallel runs never share queues."""
    server = RedisServer(free_port()).start()
    yield server
    server.cleanup()


_db_numbers = itertools.cycle(range(1, 64))


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A flushed Redis database of its own for this test."""
    url = f"{redis_server.url}/{next(_db_numbers)}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'dex.db'}"


@pytest.fixture
def sqlite_store(sqlite_url: str) -> Iterator[Store]:
    """A store on a fresh SQLite file, its tables created; closed after the test."""
    with open_store(sqlite_url) as store:
        yield store


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped after the test."""
    if not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("DEX_TEST_POSTGRES_URL must be set on CI")
        pytest.skip("DEX_TEST_POSTGRES_URL is not set")
    name = f"dex_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base, _, _ = POSTGRES_URL.rpartition("/")
    yield f"{base}/{name}"
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def pooler() -> Iterator[PgBouncer]:
    """A PgBouncer of this run (Debian's package, ``pool_mode = transaction``, a free port)
    in front of the machine's PostgreSQL; see ``tests/pgbouncer.py``."""
    if not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("DEX_TEST_POSTGRES_URL must be set on CI")
        pytest.skip("DEX_TEST_POSTGRES_URL is not set")
    require_pgbouncer()
    host, port = make_url(POSTGRES_URL).host, make_url(POSTGRES_URL).port or 5432
    bouncer = PgBouncer(server=f"{host}:{port}").start()
    yield bouncer
    bouncer.cleanup()


@pytest.fixture
def pooled_postgres_url(postgres_url: str, pooler: PgBouncer,
                        monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh PostgreSQL database reached through :func:`pooler`, with
    ``DEX_STORE_POOLER=transaction`` set for this test (stores it builds, and the
    subprocesses it starts with ``settings_env``, see the pooler)."""
    monkeypatch.setenv("DEX_STORE_POOLER", "transaction")
    return pooler.url(postgres_url)


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    """Each store test runs once on SQLite and once on PostgreSQL."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return str(request.getfixturevalue(fixture))


_STATE_DIR = Path(tempfile.mkdtemp(prefix="dex-test-state-"))


def fast_settings(redis_url: str, database_url: str, **overrides: object) -> DexSettings:
    """Settings with short leases and windows, so failures surface in seconds."""
    values: dict[str, object] = {
        "redis_url": redis_url,
        "database_url": database_url,
        "secret_key": "test-secret-key",
        "lease_seconds": 3.0,
        "republish_after_seconds": 2.0,
        "sweep_interval_seconds": 0.5,
        "retry_backoff_base_seconds": 0.05,
        "retry_backoff_max_seconds": 0.2,
        "publish_timeout_seconds": 1.0,
        # Beats of this run keep their schedules here, not in the user's state directory.
        "state_dir": _STATE_DIR,
    }
    values.update(overrides)
    return DexSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def settings(redis_url: str, sqlite_url: str) -> DexSettings:
    return fast_settings(redis_url, sqlite_url)


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.jsonl"


def settings_env(settings: DexSettings, ledger: Path | None = None) -> dict[str, str]:
    """The environment a subprocess needs to see ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
    for name, value in settings.model_dump().items():
        if value is None:
            continue  # unset: the subprocess sees no variable, as the default intends
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"DEX_{name.upper()}"] = str(value)
    if ledger is not None:
        env["DEX_EXAMPLE_LEDGER"] = str(ledger)
    env["PYTHONUNBUFFERED"] = "1"
    # Workers of tests log at INFO (the default is WARNING): tests wait for their "ready." line
    # and read the lines they log per call.
    env["DEX_WORKER_LOGLEVEL"] = "INFO"
    return env


@pytest.fixture
def env(settings: DexSettings, ledger_path: Path) -> dict[str, str]:
    return settings_env(settings, ledger_path)


@pytest.fixture
def client(settings: DexSettings) -> Iterator[DexClient]:
    with DexClient(settings) as c:
        yield c


StartWorker = Callable[..., WorkerProcess]


@pytest.fixture
def start_worker(env: dict[str, str], tmp_path: Path) -> Iterator[StartWorker]:
    """Start ``dex-tasks worker`` subprocesses; all are killed at teardown."""
    started: list[WorkerProcess] = []
    counter = itertools.count()

    def start(concurrency: int = 2, tools: str = "workers.example_tools",
              extra_env: dict[str, str] | None = None, wait: bool = True,
              serve: str | None = None, pool: str | None = None,
              events: bool = False, args: list[str] | None = None) -> WorkerProcess:
        log_path = tmp_path / f"worker-{next(counter)}.log"
        options = [*(["--serve", serve] if serve else []), *(["--pool", pool] if pool else []),
                   *(["--events"] if events else []), *(args or [])]
        proc = start_process(["worker", "--tools", tools, "-c", str(concurrency), *options],
                             {**env, **(extra_env or {})}, log_path)
        worker = WorkerProcess(proc, log_path)
        started.append(worker)
        return worker.wait_ready() if wait else worker

    yield start
    for worker in started:
        worker.discard()


@pytest.fixture
def beat(env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A ``dex-tasks beat`` for this test (its log in ``tmp_path / "beat.log"``), SIGKILLed at
    teardown."""
    proc = start_process(["beat"], env, tmp_path / "beat.log")
    yield proc
    proc.kill()
    proc.wait(10)


@pytest.fixture
def rt(client: DexClient) -> Iterator[Runtime]:
    """A sweep runtime in the test process, sharing the client's store and Celery app."""
    runtime = Runtime(settings=client.settings, store=client.store,
                      redis=redis.Redis.from_url(client.settings.redis_url), app=client.app)
    yield runtime
    runtime.redis.close()


@pytest.fixture
def sweeping(rt: Runtime) -> Iterator[list[int]]:
    """Run the lease reaper and the republisher every 0.2 s in this process, far more often
    than beat; yields how many calls each round moved. A job that finds the store unreachable
    (a test cut it) moved nothing."""
    moved: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.2):
            count = 0
            for job in ("reap_expired_leases", "republish_stranded"):
                try:
                    count += run_job(rt, job)
                except StoreUnavailableError:
                    pass
            moved.append(count)

    thread = threading.Thread(target=loop, name="test-sweeper", daemon=True)
    thread.start()
    yield moved
    stop.set()
    thread.join(30)
