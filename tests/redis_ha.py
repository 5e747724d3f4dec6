"""Real Redis topologies for the high-availability tests: Sentinel, and TLS with a test CA.

Everything is started from the ``redis-server`` binary on free ports and stopped by PID:
a Sentinel group is a master, a replica and three ``redis-server --sentinel`` processes; a TLS
server listens only on ``--tls-port``, with certificates that ``openssl`` makes for the test.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tests.helpers import RedisServer, free_port, wait_until

MASTER_NAME = "dexmaster"


@dataclass
class Sentinel:
    """One ``redis-server --sentinel`` process with its own config file (Sentinel rewrites it)."""

    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, master_port: int, quorum: int, address: str = "127.0.0.1") -> Sentinel:
        conf = self.dir / f"sentinel-{self.port}.conf"
        binds = " ".join(dict.fromkeys(("127.0.0.1", address)))
        # Fast failure detection so a test fails over in seconds, not the default 30 s.
        conf.write_text(
            f"port {self.port}\nbind {binds}\ndir {self.dir}\n"
            f"protected-mode {'yes' if address == '127.0.0.1' else 'no'}\n"
            f"sentinel monitor {MASTER_NAME} {address} {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
            f"sentinel failover-timeout {MASTER_NAME} 5000\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not on PATH"
        self.proc = subprocess.Popen([binary, str(conf), "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=0.5,
                           decode_responses=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class SentinelGroup:
    """A master, one replica and three Sentinels watching them (quorum 2)."""

    master: RedisServer
    replica: RedisServer
    sentinels: list[Sentinel]

    @property
    def url(self) -> str:
        """``DEX_REDIS_URL`` for this group (database 0)."""
        return self.url_at("127.0.0.1")

    def url_at(self, address: str) -> str:
        """``DEX_REDIS_URL`` for this group as hosts reach it at ``address`` (database 0)."""
        return ";".join(f"sentinel://{address}:{s.port}/0" for s in self.sentinels)

    def master_port(self) -> int | None:
        """The master's port as a majority of the Sentinels see it now."""
        seen: dict[int, int] = {}
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                addr = client.execute_command("SENTINEL", "get-master-addr-by-name",
                                              MASTER_NAME)
            except redis.RedisError:
                continue
            finally:
                client.close()
            if addr:
                port = int(addr[1])
                seen[port] = seen.get(port, 0) + 1
        best = max(seen.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the replica is in sync and every Sentinel knows the replica and the others."""
        def replica_synced() -> bool:
            info = _info(self.replica.port, "replication")
            return info.get("master_link_status") == "up"

        def sentinels_know_everyone() -> bool:
            for sentinel in self.sentinels:
                client = sentinel.client()
                try:
                    replicas = client.execute_command("SENTINEL", "replicas", MASTER_NAME)
                    others = client.execute_command("SENTINEL", "sentinels", MASTER_NAME)
                except redis.RedisError:
                    return False
                finally:
                    client.close()
                if len(replicas) < 1 or len(others) < len(self.sentinels) - 1:
                    return False
            return True

        wait_until(replica_synced, timeout, "the replica to sync with the master")
        wait_until(sentinels_know_everyone, timeout,
                   "the Sentinels to discover the replica and each other")

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        self.replica.cleanup()
        self.master.cleanup()


def start_sentinel_group(address: str = "127.0.0.1",
                         extra: list[str] | None = None) -> SentinelGroup:
    """Start the group and wait until it could fail over.

    ``address``: where the hosts reach the group (every server also listens on 127.0.0.1),
    e.g. a network's infrastructure host (``tests/netns.py``); the Sentinels give that address
    for the master. ``extra``: more options for both Redis servers (``--appendonly yes``).
    """
    binds = ["--bind", *dict.fromkeys(("127.0.0.1", address)), *(extra or [])]
    if address != "127.0.0.1":
        # Peers on another address (the hosts, the replica linking to it) are not loopback.
        binds += ["--protected-mode", "no"]
    master = RedisServer(free_port(), extra=binds).start()
    replica = RedisServer(free_port(),
                          extra=[*binds, "--replicaof", address, str(master.port)]).start()
    workdir = Path(tempfile.mkdtemp(prefix="dex-sentinel-"))
    sentinels = [Sentinel(free_port(), workdir).start(master.port, quorum=2, address=address)
                 for _ in range(3)]
    group = SentinelGroup(master, replica, sentinels)
    try:
        group.wait_ready()
    except BaseException:
        group.stop()
        raise
    return group


def _info(port: int, section: str) -> dict[str, Any]:
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=0.5)
    try:
        return dict(client.info(section))
    except redis.RedisError:
        return {}
    finally:
        client.close()


# -- TLS ----------------------------------------------------------------------------------------


@dataclass
class Certificates:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""

    dir: Path
    ca: Path = field(init=False)
    server_cert: Path = field(init=False)
    server_key: Path = field(init=False)
    client_cert: Path = field(init=False)
    client_key: Path = field(init=False)

    def __post_init__(self) -> None:
        d = self.dir
        self.ca, ca_key = d / "ca.crt", d / "ca.key"
        self.server_cert, self.server_key = d / "server.crt", d / "server.key"
        self.client_cert, self.client_key = d / "client.crt", d / "client.key"
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                 "-subj", "/CN=dex-tasks test CA", "-keyout", ca_key, "-out", self.ca)
        san = d / "san.cnf"
        san.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for name, cert, key, ext in (("127.0.0.1", self.server_cert, self.server_key, san),
                                     ("dex-tasks test client", self.client_cert,
                                      self.client_key, None)):
            csr = d / f"{cert.stem}.csr"
            _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                     "-keyout", key, "-out", csr)
            _openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", ca_key,
                     "-CAcreateserial", "-days", "1", "-out", cert,
                     *(["-extfile", ext] if ext else []))


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def start_tls_redis(certs: Certificates) -> RedisServer:
    """A redis-server that speaks only TLS and requires a client certificate from our CA."""
    port = free_port()
    server = RedisServer(port, extra=[
        "--port", "0", "--tls-port", str(port),
        "--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
        "--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "yes",
    ])
    # RedisServer.start pings over plain TCP; this one must be pinged over TLS.
    binary = shutil.which("redis-server")
    assert binary is not None
    server.proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--save", "", "--dir", server.dir,
         "--databases", "64", *server.extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, ssl=True, ssl_ca_certs=str(certs.ca),
                         ssl_certfile=str(certs.client_cert), ssl_keyfile=str(certs.client_key),
                         socket_connect_timeout=0.5)

    def pings() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        wait_until(pings, 10, f"the TLS redis-server on port {port}")
    finally:
        client.close()
    return server
