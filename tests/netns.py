"""Hosts as network namespaces, and real network partitions between them (root only).

A :class:`Network` is a bridge in the root namespace with an address of its own on a private
/24 that only this network uses (``10.213.N.0/24``, ``N`` picked free): that address is the
*infrastructure host*, where a private ``redis-server`` listens and a forwarder passes TCP on
to PostgreSQL on 127.0.0.1. Each :class:`Host` is a namespace joined to the bridge by a veth
pair; ``dex-tasks worker``, ``beat`` or any script runs inside it with ``ip netns exec``.

:meth:`Host.cut` drops, with iptables rules inside the host's own namespace, every packet
between the host and one service (or all of them), both ways and silently: no RST, no ICMP,
as when a cable or a switch dies. :meth:`Host.heal` removes the rules. Traffic never leaves
the namespaces this module made and the bridge between them.

:meth:`Network.close` (also at interpreter exit, and from the pytest fixture on failure)
kills every process it started, by PID, deletes the namespaces (with their rules and veth
ends) and the bridge.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dex_tasks.ops.procutil import free_port

ROOT = Path(__file__).resolve().parent.parent
SUBNET_BASE = "10.213"


def missing_tools() -> list[str]:
    """What this machine lacks to build networks: root, ``ip``, ``iptables``."""
    missing = [] if os.geteuid() == 0 else ["root"]
    missing += [tool for tool in ("ip", "iptables", "redis-server") if shutil.which(tool) is None]
    return missing


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


def _free_subnet() -> int:
    """A third octet no interface of this machine uses under 10.213."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout
    for _ in range(100):
        n = secrets.randbelow(250) + 1
        if f"{SUBNET_BASE}.{n}." not in used:
            return n
    raise RuntimeError(f"no free {SUBNET_BASE}.N.0/24 subnet")


class Forwarder:
    """TCP forwarding from ``listen`` (an address on the bridge) to ``target``, in a thread.

    A connection's two halves are independent: when a partition drops one side's packets,
    the other side sees nothing at all, as a proxy or a NAT in a real network would.
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen = listen
        self.target = target
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="netns-forwarder", daemon=True)
        self.server: asyncio.Server | None = None

    def start(self) -> Forwarder:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("the forwarder did not start")
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._link, *self.listen))
        self.ready.set()
        self.loop.run_forever()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        try:
            with contextlib.suppress(asyncio.CancelledError):  # the forwarder is stopping
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.transport.abort()

    async def _shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def stop(self) -> None:
        """Close every link and the listening socket, then the loop."""
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Host:
    """One namespace on the network: its name, address and the processes started in it."""

    network: Network
    name: str
    namespace: str
    address: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    rules: list[list[str]] = field(default_factory=list)

    def run(self, args: list[str], env: dict[str, str], log_path: Path,
            cwd: Path = ROOT) -> subprocess.Popen[bytes]:
        """Start ``args`` inside this host (its own session), output to ``log_path``."""
        log: IO[bytes] = open(log_path, "ab")
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace, *args], cwd=cwd,
                                    env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    def _rules_for(self, port: int | None) -> list[list[str]]:
        infra = self.network.infra
        tcp = ["-p", "tcp"] if port is not None else []
        return [["INPUT", "-s", infra, *tcp, *(["--sport", str(port)] if port else []),
                 "-j", "DROP"],
                ["OUTPUT", "-d", infra, *tcp, *(["--dport", str(port)] if port else []),
                 "-j", "DROP"]]

    def cut(self, *services: str) -> float:
        """Drop every packet between this host and ``services`` ("redis", "store"; none:
        everything on the infrastructure host), both ways, silently. Returns the time."""
        ports: list[int | None] = ([self.network.port(s) for s in services] if services
                                   else [None])
        for port in ports:
            for rule in self._rules_for(port):
                _run("ip", "netns", "exec", self.namespace, "iptables", "-I", *rule)
                self.rules.append(rule)
        return time.time()

    def heal(self) -> float:
        """Remove every rule :meth:`cut` added. Returns the time."""
        while self.rules:
            rule = self.rules.pop()
            _run("ip", "netns", "exec", self.namespace, "iptables", "-D", *rule, check=False)
        return time.time()

    def kill(self) -> None:
        """SIGKILL every process started here (a host that is gone for good)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


class Network:
    """A private network of hosts around the infrastructure host (see the module's doc)."""

    def __init__(self) -> None:
        missing = missing_tools()
        if missing:
            raise RuntimeError(f"network namespaces need {', '.join(missing)}")
        self.tag = secrets.token_hex(3)
        self.subnet = _free_subnet()
        self.infra = f"{SUBNET_BASE}.{self.subnet}.1"
        self.bridge = f"dxb{self.tag}"
        self.hosts: list[Host] = []
        self.ports: dict[str, int] = {}
        self.redis: subprocess.Popen[bytes] | None = None
        self.redis_dir: str | None = None
        self.forwarders: list[Forwarder] = []
        self.closed = False
        atexit.register(self.close)
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.infra}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    def port(self, service: str) -> int:
        try:
            return self.ports[service]
        except KeyError:
            raise ValueError(f"no service {service!r} on this network; "
                             f"known: {', '.join(sorted(self.ports))}") from None

    def add_host(self, name: str) -> Host:
        """A new namespace joined to the bridge, with its loopback up."""
        n = len(self.hosts) + 1
        namespace = f"dx{self.tag}-{name}"
        outer = f"dxh{self.tag}{n}"
        address = f"{SUBNET_BASE}.{self.subnet}.{10 + n}"
        host = Host(self, name, namespace, address)
        self.hosts.append(host)
        _run("ip", "netns", "add", namespace)
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns",
             namespace)
        _run("ip", "link", "set", outer, "master", self.bridge, "up")
        inside = ("ip", "netns", "exec", namespace)
        _run(*inside, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
        _run(*inside, "ip", "link", "set", "eth0", "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        return host

    def start_redis(self) -> str:
        """A private redis-server on the infrastructure host (and 127.0.0.1); its URL as the
        hosts reach it. The test process reaches it at ``redis://127.0.0.1:<port>``."""
        port = free_port()
        binary = shutil.which("redis-server")
        assert binary is not None
        self.redis_dir = f"/tmp/dex-netns-redis-{self.tag}"
        os.makedirs(self.redis_dir, exist_ok=True)
        self.redis = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", self.infra, "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--dir", self.redis_dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ports["redis"] = port
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                import socket

                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return f"redis://{self.infra}:{port}"
            time.sleep(0.05)
        raise RuntimeError("the network's redis-server did not start")

    def forward(self, service: str, target: tuple[str, int]) -> tuple[str, int]:
        """Make ``target`` (on this machine's loopback) reachable from the hosts at an address
        of the infrastructure host; returns that address."""
        port = free_port()
        self.forwarders.append(Forwarder((self.infra, port), target).start())
        self.ports[service] = port
        return self.infra, port

    def close(self) -> None:
        """Kill what ran here, delete the namespaces and the bridge; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for host in self.hosts:
            host.kill()
        for n, host in enumerate(self.hosts, 1):
            _run("ip", "netns", "del", host.namespace, check=False)
            # The kernel frees a namespace's devices in the background: the outer veth end
            # is deleted here, so nothing of this network outlives close().
            _run("ip", "link", "del", f"dxh{self.tag}{n}", check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        for forwarder in self.forwarders:
            forwarder.stop()
        if self.redis is not None and self.redis.poll() is None:
            self.redis.kill()
            self.redis.wait(10)
        if self.redis_dir:
            shutil.rmtree(self.redis_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
