"""A private PostgreSQL server for the tests and scenarios that need one of their own (a small
``max_connections``, a server to stop), from the machine's PostgreSQL binaries.

:class:`PostgresServer` runs ``initdb`` into a temporary folder and starts ``postgres`` on a free
port of 127.0.0.1 (trust authentication, its Unix socket in that folder), as the ``postgres``
user when started by root (PostgreSQL refuses to run as root). It is stopped by its PID and the
folder removed.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import free_port, wait_until

RUN_AS = "postgres"


def postgres_bin(name: str) -> str:
    """A PostgreSQL server binary (``initdb``, ``postgres``) of the newest installed version."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"no PostgreSQL {name} under /usr/lib/postgresql")
    return found[-1]


def _as_postgres() -> None:  # a preexec_fn: drop to the postgres user when root
    if os.geteuid() == 0:
        user = pwd.getpwnam(RUN_AS)
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)


@dataclass
class PostgresServer:
    """One ``postgres`` on a free port with ``settings`` (``max_connections`` and so on)."""

    settings: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dex-postgres-")))

    @property
    def data(self) -> Path:
        return self.dir / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> PostgresServer:
        self.port = self.port or free_port()
        if os.geteuid() == 0:
            shutil.chown(self.dir, RUN_AS, RUN_AS)
        subprocess.run([postgres_bin("initdb"), "-D", str(self.data), "-U", "postgres",
                        "--auth=trust", "--no-sync", "-E", "UTF8"],
                       check=True, capture_output=True, timeout=120, preexec_fn=_as_postgres)
        options = {"listen_addresses": "127.0.0.1", "port": str(self.port),
                   "unix_socket_directories": str(self.dir), **self.settings}
        args = [postgres_bin("postgres"), "-D", str(self.data)]
        for name, value in options.items():
            args += ["-c", f"{name}={value}"]
        log = open(self.dir / "postgres.log", "ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_as_postgres, start_new_session=True)
        finally:
            log.close()
        wait_until(self._ready, 60, f"postgres on port {self.port}")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"postgres exited ({self.proc.returncode}):\n{self.log()[-2000:]}")
        done = subprocess.run([postgres_bin("pg_isready"), "-h", "127.0.0.1", "-p",
                               str(self.port)], capture_output=True, timeout=10)
        return done.returncode == 0

    def log(self) -> str:
        path = self.dir / "postgres.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Stop the server (fast shutdown, then SIGKILL) and remove its folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
