"""A private PgBouncer (Debian's ``pgbouncer`` package) in front of a PostgreSQL server, for the
tests that run dex-tasks behind a transaction pooler.

:class:`PgBouncer` writes its own ``pgbouncer.ini`` into a temporary folder, listens on a free
port of 127.0.0.1 (no Unix socket), and is stopped by its PID. Every database of the server is
reachable through it under its own name (the ``*`` fallback entry), so a test's fresh database
(``postgres_url``) works through the pooler as it is: :meth:`PgBouncer.url` points a database
URL at it. ``server`` is where PgBouncer connects: the machine's PostgreSQL, or a
``tests/tcp_proxy.py`` in between that a test cuts to partition the pooler from the server.

The defaults are the pooler an operator puts in front of a fleet (``pool_mode =
transaction``, ``ignore_startup_parameters`` left at PgBouncer's own); ``settings`` adds or
replaces lines of the ``[pgbouncer]`` section, ``auth`` switches client authentication from
``trust`` to ``scram-sha-256`` with those users and passwords.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dex_tasks.ops.procutil import free_port, wait_until

# PgBouncer refuses to run as root; started by root it switches to this user (-u).
RUN_AS = "postgres"
MISSING = "pgbouncer is not installed (apt-get install pgbouncer)"


def pgbouncer_binary() -> str | None:
    """The ``pgbouncer`` executable (Debian installs it in /usr/sbin), or None."""
    found = shutil.which("pgbouncer")
    if found is None and os.path.exists("/usr/sbin/pgbouncer"):
        found = "/usr/sbin/pgbouncer"
    return found


def require_pgbouncer() -> str:
    """The ``pgbouncer`` executable; in a test where it is missing, skips (fails on CI, where
    ``.ci/run`` installs it)."""
    binary = pgbouncer_binary()
    if binary is None:
        import pytest

        if os.environ.get("CI"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    return binary


@dataclass
class PgBouncer:
    """One ``pgbouncer`` process on a free port in front of ``server`` (host:port)."""

    server: str = "127.0.0.1:5432"
    settings: Mapping[str, str] = field(default_factory=dict)
    auth: Mapping[str, str] | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dex-pgbouncer-")))

    def config(self) -> str:
        """The ``pgbouncer.ini`` this instance runs with."""
        host, _, port = self.server.rpartition(":")
        values = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust" if self.auth is None else "scram-sha-256",
            "auth_file": str(self.dir / "userlist.txt"),
            "pool_mode": "transaction",
            "max_client_conn": "1000",
            "default_pool_size": "20",
            # A server the test cut is tried again at once when it is back.
            "server_login_retry": "1",
            "logfile": str(self.dir / "pgbouncer.log"),
            "pidfile": str(self.dir / "pgbouncer.pid"),
            "admin_users": "postgres",
            **self.settings,
        }
        lines = ["[databases]", f"* = host={host} port={port}", "", "[pgbouncer]"]
        lines += [f"{name} = {value}" for name, value in values.items()]
        return "\n".join(lines) + "\n"

    def start(self) -> PgBouncer:
        binary = pgbouncer_binary()
        if binary is None:
            raise RuntimeError(MISSING)
        self.port = self.port or free_port()
        users = self.auth if self.auth is not None else {"postgres": ""}
        (self.dir / "userlist.txt").write_text(
            "".join(f'"{user}" "{password}"\n' for user, password in users.items()))
        (self.dir / "pgbouncer.ini").write_text(self.config())
        command = [binary, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            shutil.chown(self.dir, RUN_AS)
            for path in self.dir.iterdir():
                shutil.chown(path, RUN_AS)
            command[1:1] = ["-u", RUN_AS]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_until(self._listening, 15, f"pgbouncer on port {self.port}")
        return self

    def _listening(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}:\n{self.log()}")
        host = self.settings.get("listen_addr", "127.0.0.1").split(",")[0].strip()
        try:
            socket.create_connection(("127.0.0.1" if host in ("*", "0.0.0.0") else host,
                                      self.port), timeout=0.5).close()
        except OSError:
            return False
        return True

    def url(self, database_url: str, **parts: str | int) -> str:
        """``database_url`` pointed at this pooler (``parts``: URL parts to set besides, or
        instead, such as ``username``, ``password``, or ``host`` where ``listen_addr`` is
        another address than 127.0.0.1)."""
        from sqlalchemy.engine import make_url

        where: dict[str, Any] = {"host": "127.0.0.1", "port": self.port, **parts}
        url = make_url(database_url).set(**where)
        return url.render_as_string(hide_password=False)

    def log(self) -> str:
        """What PgBouncer logged."""
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def pgbouncer(server: str = "127.0.0.1:5432", **options: Any) -> Iterator[PgBouncer]:
    """A started :class:`PgBouncer` for the ``with`` block of a test (``options``: its
    fields)."""
    require_pgbouncer()
    bouncer = PgBouncer(server=server, **options).start()
    try:
        yield bouncer
    finally:
        bouncer.cleanup()
