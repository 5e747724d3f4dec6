"""What waiting cannot fix ends a process at once, in one line; what it can is waited for, one
line per try with the URL and the time so far (issue 30 item 2, issue 31's Redis bullet).

Against real servers: the machine's PostgreSQL (roles and databases that do not exist), a
PgBouncer that asks for a password or refuses the startup ``options`` (``tests/pgbouncer.py``),
a Redis started with ``--requirepass`` and one with an ACL user that lacks a command. Every
process is a real ``dex-tasks`` subprocess, or ``DexClient`` in this one.

A schema older than the code is the same kind of mistake, proven for the worker, beat, the
API and a client by ``test_migrations.py::test_worker_beat_and_api_refuse_an_out_of_date_schema``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from dex_tasks import BrokerRefusedError, DexClient, StoreRefusedError
from tests.conftest import POSTGRES_URL as POSTGRES_ADMIN
from tests.conftest import fast_settings, settings_env
from tests.helpers import (
    ROOT,
    RedisServer,
    TcpProxy,
    WorkerProcess,
    free_port,
    start_process,
    wait_until,
)
from tests.pgbouncer import PgBouncer, pgbouncer
from workers import example_tools

# Registered in this process: an agent here calls them with no worker's catalog published.
assert example_tools.lookup_order

# Passwords that must never show in any output.
REDIS_PASSWORD = "redis-secret-3141"
STORE_PASSWORD = "store-secret-2718"
WRONG_PASSWORD = "wrong-secret-1618"

# Generous for a loaded 2-core machine (a process takes seconds to import its libraries);
# the processes this replaces waited 60 s for the store and for ever for Redis.
EXIT_WITHIN = 40.0

PROCESSES = {
    "worker": ["worker", "--tools", "workers.example_tools", "-c", "1"],
    "beat": ["beat"],
    "api": ["api", "--port", "1"],
    "calls": ["calls", "s"],
    "sweep": ["sweep"],
}


@dataclass
class Ended:
    """How a process ended: its exit status, its output (stdout and stderr), its time."""

    returncode: int
    output: str
    seconds: float

    def one_line(self, *says: str) -> str:
        """Assert the output is one ``error:`` line saying each of ``says``, and no secret."""
        lines = [line for line in self.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), self.output
        for text in says:
            assert text in lines[0], (text, lines[0])
        for secret in (REDIS_PASSWORD, STORE_PASSWORD, WRONG_PASSWORD):
            assert secret not in self.output
        assert "Traceback" not in self.output and "trying again" not in self.output
        return lines[0]


def run_processes(names: list[str], env: dict[str, str], tmp_path: Path) -> dict[str, Ended]:
    """Start ``dex-tasks`` processes at once; how each ended (each must end non-zero within
    :data:`EXIT_WITHIN` seconds)."""
    started = time.monotonic()
    procs = {name: start_process(PROCESSES[name], env, tmp_path / f"{name}.log")
             for name in names}
    ended = {}
    try:
        for name, proc in procs.items():
            code = proc.wait(EXIT_WITHIN + 30)
            ended[name] = Ended(code, (tmp_path / f"{name}.log").read_text(),
                                time.monotonic() - started)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for name, end in ended.items():
        assert end.returncode == 2, (name, end.output)
        assert end.seconds < EXIT_WITHIN, (name, end.seconds)
    return ended


def env_for(redis_url: str, database_url: str, **extra: str) -> dict[str, str]:
    env = settings_env(fast_settings(redis_url, database_url))
    env.pop("DEX_STORE_POOLER", None)
    return {**env, **extra}


# -- the store ------------------------------------------------------------------------------


def store_url(user: str = "postgres", password: str | None = None, host: str = "127.0.0.1",
              port: int = 5432, database: str = "test") -> str:
    auth = f"{user}:{password}" if password is not None else user
    return f"postgresql+psycopg://{auth}@{host}:{port}/{database}"


@pytest.fixture
def postgres_required(postgres_url: str) -> str:
    """Skips (fails on CI) where the machine's PostgreSQL is not configured."""
    return postgres_url


def test_every_process_refuses_a_database_that_does_not_exist_in_one_line(
        postgres_required: str, redis_url: str, tmp_path: Path) -> None:
    # Given a URL (with a password) naming a database that does not exist
    url = store_url(password=STORE_PASSWORD, database="dex_no_such_database")
    env = env_for(redis_url, url)
    # When each kind of process starts on it, then each ends at once with one line naming
    # the database and the fix, and no password
    for name, end in run_processes(list(PROCESSES), env, tmp_path).items():
        line = end.one_line('database "dex_no_such_database" does not exist',
                            "postgresql+psycopg://postgres:***@127.0.0.1:5432/",
                            "CREATE DATABASE")
        assert "has no such database" in line, name
    # And an agent's client refuses the same way, at once
    started = time.monotonic()
    with pytest.raises(StoreRefusedError, match="has no such database"):
        DexClient(fast_settings(redis_url, url))
    assert time.monotonic() - started < 5


def test_a_role_that_does_not_exist_is_refused_at_once(
        postgres_required: str, redis_url: str, tmp_path: Path) -> None:
    url = store_url(user="dex_no_such_role", password=STORE_PASSWORD)
    end = run_processes(["worker"], env_for(redis_url, url), tmp_path)["worker"]
    end.one_line('has no such role (role "dex_no_such_role" does not exist)', "CREATE ROLE")
    with pytest.raises(StoreRefusedError, match="has no such role"):
        DexClient(fast_settings(redis_url, url))


@pytest.fixture
def password_pooler(postgres_required: str) -> Iterator[PgBouncer]:
    """A PgBouncer that asks its clients for a password (SCRAM): the machine's PostgreSQL
    trusts every local login, so this is where a wrong one is refused. Its clients use the
    test's own fresh database (``postgres_required``): the machine's ``test`` database is shared
    by every run and may hold another release's schema."""
    with pgbouncer(auth={"postgres": STORE_PASSWORD}) as bouncer:
        yield bouncer


def test_a_wrong_store_password_is_refused_at_once(
        password_pooler: PgBouncer, postgres_required: str, redis_url: str,
        tmp_path: Path) -> None:
    # Given the right password works (through the pooler, told of it)
    database = postgres_required.rsplit("/", 1)[1]
    right = store_url(password=STORE_PASSWORD, port=password_pooler.port, database=database)
    with DexClient(fast_settings(redis_url, right, store_pooler="transaction")) as client:
        assert client.store.store_time() > 0
    # When a worker and an agent start with a wrong one
    wrong = store_url(password=WRONG_PASSWORD, port=password_pooler.port, database=database)
    env = env_for(redis_url, wrong, DEX_STORE_POOLER="transaction")
    end = run_processes(["worker"], env, tmp_path)["worker"]
    # Then each refuses at once, naming the cause and where to fix it, without a password
    end.one_line("refused the login (SASL authentication failed)",
                 "check the user name and password in DEX_DATABASE_URL")
    with pytest.raises(StoreRefusedError, match="refused the login") as err:
        DexClient(fast_settings(redis_url, wrong, store_pooler="transaction"))
    assert WRONG_PASSWORD not in str(err.value)


def test_a_pooler_refusing_the_startup_options_names_the_setting(
        postgres_required: str, pooler: PgBouncer, redis_url: str, tmp_path: Path) -> None:
    # Given PgBouncer (transaction mode, its default startup parameters) and processes that
    # were not told of it
    url = pooler.url(postgres_required)
    end = run_processes(["worker", "beat"], env_for(redis_url, url), tmp_path)
    # Then they refuse at once, naming the parameter and the setting that fixes it
    for name in ("worker", "beat"):
        end[name].one_line("refused a startup parameter (unsupported startup parameter: "
                           "options)", "set DEX_STORE_POOLER=transaction")
    # And a parameter of the URL's own, which the pooler refuses too, is named with its fix
    own = pooler.url(postgres_required) + "?options=-c%20work_mem%3D8MB"
    with pytest.raises(StoreRefusedError, match="remove options from DEX_DATABASE_URL"):
        DexClient(fast_settings(redis_url, own, store_pooler="transaction"))


def test_a_pooler_dropping_the_startup_options_names_the_setting(
        postgres_required: str, redis_url: str, tmp_path: Path) -> None:
    with pgbouncer(settings={"ignore_startup_parameters": "extra_float_digits, options"}) as b:
        url = b.url(postgres_required)
        end = run_processes(["worker"], env_for(redis_url, url), tmp_path)["worker"]
    end.one_line("ignored the startup options dex-tasks sent",
                 "set DEX_STORE_POOLER=transaction")


@pytest.mark.parametrize("process", ["worker", "beat", "api", "sweep", "agent"])
def test_a_postgresql_url_without_the_postgres_extra_names_the_extra(process: str,
                                                                     redis_url: str) -> None:
    # Given an environment where psycopg cannot be imported (None in sys.modules blocks it)
    run = ("from dex_tasks import DexClient; DexClient.from_env()" if process == "agent" else
           f"from dex_tasks.ops.cli import main; main({PROCESSES[process]!r})")
    script = f"import sys; sys.modules['psycopg'] = None\n{run}\n"
    env = env_for(redis_url, store_url(password=STORE_PASSWORD))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    # Then the process ends at once, naming the extra to install
    assert time.monotonic() - started < EXIT_WITHIN
    assert result.returncode != 0
    says = ("is a PostgreSQL URL, but its driver is not installed: "
            'pip install -e ".[postgres]" in the dex-tasks checkout')
    if process == "agent":
        # (a library raises: ConfigurationError's one line is the traceback's last)
        assert result.stderr.strip().splitlines()[-1].endswith(says), result.stderr
        assert STORE_PASSWORD not in result.stderr
    else:
        Ended(result.returncode, result.stdout + result.stderr, 0).one_line(says)
        assert result.returncode == 2


# -- Redis ----------------------------------------------------------------------------------


def documented_acl() -> list[str]:
    """The rules of docs/deploying.md's ``ACL SETUSER dex on >PASSWORD ...`` line."""
    page = (ROOT / "docs" / "deploying.md").read_text()
    found = re.search(r"^ACL SETUSER dex on >PASSWORD (.+)$", page, re.M)
    assert found is not None, "docs/deploying.md shows no ACL line for dex-tasks' user"
    return found[1].split()


@pytest.fixture(scope="module")
def guarded_redis() -> Iterator[RedisServer]:
    """A Redis started with --requirepass, and an ACL user ``dex`` who may not BRPOP."""
    server = RedisServer(free_port(), password=REDIS_PASSWORD).start()
    admin = redis.Redis(port=server.port, password=REDIS_PASSWORD)
    admin.execute_command("ACL", "SETUSER", "dex", "on", f">{REDIS_PASSWORD}", "~*", "&*",
                          "+@all", "-@dangerous", "+info", "-brpop")
    # What docs/deploying.md tells operators to give dex-tasks' user
    admin.execute_command("ACL", "SETUSER", "documented", "on", f">{REDIS_PASSWORD}",
                          *documented_acl())
    admin.close()
    yield server
    server.cleanup()


def test_every_process_refuses_a_wrong_redis_password_in_one_line(
        guarded_redis: RedisServer, sqlite_url: str, tmp_path: Path) -> None:
    url = f"redis://:{WRONG_PASSWORD}@127.0.0.1:{guarded_redis.port}/0"
    env = env_for(url, sqlite_url)
    for end in run_processes(["worker", "beat", "api", "sweep"], env, tmp_path).values():
        end.one_line(f"Redis at redis://:***@127.0.0.1:{guarded_redis.port}/0 refused the "
                     "password of the default user", "check the user name and password")
    with pytest.raises(BrokerRefusedError, match="refused the password"):
        DexClient(fast_settings(url, sqlite_url))


def test_a_redis_that_asks_for_a_password_is_refused_in_one_line(
        guarded_redis: RedisServer, sqlite_url: str, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{guarded_redis.port}/0"
    end = run_processes(["worker"], env_for(url, sqlite_url), tmp_path)["worker"]
    end.one_line("requires a password (NOAUTH", "put it in DEX_REDIS_URL")
    with pytest.raises(BrokerRefusedError, match="requires a password"):
        DexClient(fast_settings(url, sqlite_url))


def test_an_acl_user_without_a_command_is_refused_by_the_process_that_needs_it(
        guarded_redis: RedisServer, sqlite_url: str, tmp_path: Path) -> None:
    # Given an ACL user who may do everything dex-tasks does but BRPOP
    url = f"redis://dex:{REDIS_PASSWORD}@127.0.0.1:{guarded_redis.port}/0"
    # When a worker starts as that user, then it refuses at once, naming the command
    end = run_processes(["worker"], env_for(url, sqlite_url), tmp_path)["worker"]
    end.one_line("refused a command to user 'dex' (NOPERM",
                 "no permissions to run the 'brpop' command", "ACL SETUSER dex")
    # And an agent, which never consumes, starts and calls as that user
    with DexClient(fast_settings(url, sqlite_url)) as client:
        record = client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                  tool="lookup_order", arguments={"order_id": "1001"})
        assert record.status.value == "queued"
    # And the user docs/deploying.md describes runs a worker
    documented = f"redis://documented:{REDIS_PASSWORD}@127.0.0.1:{guarded_redis.port}/0"
    worker = WorkerProcess(start_process(PROCESSES["worker"],
                                         env_for(documented, sqlite_url),
                                         tmp_path / "documented.log"), tmp_path / "documented.log")
    try:
        worker.wait_ready(60)
    finally:
        worker.discard()


# -- what is waited for -----------------------------------------------------------------------


def test_a_worker_waits_for_a_redis_that_is_down_saying_so_on_each_try(
        sqlite_url: str, tmp_path: Path) -> None:
    # Given no Redis yet on the port the worker is told of
    port = free_port()
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    log_path = tmp_path / "worker.log"
    worker = WorkerProcess(start_process(PROCESSES["worker"], env_for(url, sqlite_url),
                                         log_path), log_path)
    server = RedisServer(port, password=REDIS_PASSWORD)
    try:
        # When it starts, then it says once per try that Redis is not answering, with the
        # URL (no password) and how long it has been, and no Celery banner yet
        def tries() -> list[str]:
            return [line for line in worker.log().splitlines() if "startup_redis_wait" in line]

        wait_until(lambda: len(tries()) >= 3, 60, "three tries")
        for line in tries():
            assert f"Redis at redis://:***@127.0.0.1:{port}/0 is not answering" in line, line
            assert "Connection refused" in line and " so far)" in line, line
        assert tries()[2].split("(")[-1].startswith(("3 s", "4 s", "5 s", "6 s")), tries()
        assert "[queues]" not in worker.log() and "transport:" not in worker.log()
        assert worker.proc.poll() is None
        # And once Redis is there, the banner comes and the worker is ready
        server.start()
        worker.wait_ready(60)
        assert "[queues]" in worker.log()
        assert REDIS_PASSWORD not in worker.log()
    finally:
        worker.discard()
        server.cleanup()


def test_a_worker_waits_for_a_store_that_is_not_answering_saying_so_on_each_try(
        postgres_required: str, redis_url: str, tmp_path: Path) -> None:
    # Given a store that refuses connections (a server restarting)
    proxy = TcpProxy("127.0.0.1:5432").start()
    try:
        url = proxy.url(postgres_required)
        proxy.cut(600.0)
        log_path = tmp_path / "worker.log"
        worker = WorkerProcess(start_process(PROCESSES["worker"], env_for(redis_url, url),
                                             log_path), log_path)
        try:
            # When a worker starts, then it waits, one line per try with the URL and the
            # time so far, and no Celery banner yet
            def tries() -> list[str]:
                return [line for line in worker.log().splitlines()
                        if "startup_store_wait" in line]

            wait_until(lambda: len(tries()) >= 3, 90, "three tries")
            for line in tries():
                assert "the store is not answering yet" in line, line
                assert f"127.0.0.1:{proxy.port}/" in line and " s)" in line, line
            assert "[queues]" not in worker.log() and worker.proc.poll() is None
            # And once the store answers, it starts
            proxy.cut(0)
            worker.wait_ready(90)
        finally:
            worker.discard()
    finally:
        proxy.stop()


def test_a_store_that_is_read_only_for_a_while_is_waited_for(postgres_required: str) -> None:
    # Given a database whose new sessions only read (as a demoted primary's do while a
    # failover promotes another), which turns writable again 1.5 s later
    from sqlalchemy import create_engine, text

    from dex_tasks.store import Store
    from tests.test_store import call_row

    store = Store(postgres_required, retry_seconds=15.0, pooler=False)
    store.create_all()
    name = postgres_required.rsplit("/", 1)[1]
    admin = create_engine(POSTGRES_ADMIN, isolation_level="AUTOCOMMIT")

    def read_only(on: bool) -> None:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" '
                              + ("SET default_transaction_read_only = on" if on else
                                 "RESET default_transaction_read_only")))

    read_only(True)
    store.close()  # (the sessions it holds were opened writable)
    timer = threading.Timer(1.5, read_only, (False,))
    timer.start()
    try:
        # When a call is inserted and claimed meanwhile, then both wait it out and succeed
        started = time.monotonic()
        assert store.insert_call(call_row("s/t/read-only"))
        assert store.claim("s/t/read-only", "node:1", 30, lambda row: None) is not None
        assert time.monotonic() - started >= 1.0
    finally:
        timer.join()
        read_only(False)
        admin.dispose()
        store.close()


def test_a_url_that_reaches_another_kind_of_server_is_refused(sqlite_url: str) -> None:
    # Given DEX_REDIS_URL pointing at a port where a web server answers (as nginx does, with
    # a status line, to anything it cannot parse)
    import socketserver

    class Web(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(1024)
            self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    web = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Web)
    web.daemon_threads = True
    thread = threading.Thread(target=web.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"redis://127.0.0.1:{web.server_address[1]}/0"
        # When an agent starts, then it says at once that this is no Redis, and where to look
        with pytest.raises(BrokerRefusedError, match="answers, but not as Redis does"):
            DexClient(fast_settings(url, sqlite_url))
    finally:
        web.shutdown()
        web.server_close()
