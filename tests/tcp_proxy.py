"""A TCP proxy in front of a database server, which tests cut, reset and make lose a COMMIT or
any statement, or its reply.

Run as its own process (``python -m tests.tcp_proxy --target 127.0.0.1:5432``); it prints
``listening <port> control <port>`` once ready. Tests drive it through :class:`TcpProxy` in
``tests/helpers.py``, which sends one line per command to the control port:

``cut SECONDS``
    Close every open connection at once (the client sees the server go away mid-session) and
    refuse new ones for ``SECONDS``: a database restart, or a network cut, as the client sees it.
``reset``
    Close every open connection; new ones are accepted at once (``cut 0``).
``lose-commit-reply``
    The next ``COMMIT`` a client sends is forwarded; the server commits and answers, but the
    answer is dropped and both sides are closed: the client cannot tell whether it committed.
``lose-commit``
    The next ``COMMIT`` is not forwarded; both sides are closed (the server rolls back).
``lose-reply SKIP TEXT``
    Like ``lose-commit-reply`` for the statement whose message holds ``TEXT`` (the rest of the
    line), after ``SKIP`` such messages went through untouched: a statement in autocommit
    that the server runs and commits while its client never hears so.
``lose-statement SKIP TEXT``
    Like ``lose-commit`` for that statement: it never reaches the server.
``stats``
    ``open <n> accepted <n> refused <n> commits-lost <n> statements-lost <n>``.

PostgreSQL's wire protocol sends ``COMMIT`` as a simple query (``Q`` message), so the proxy
finds it by its text in the client's stream. A statement with parameters is sent as Parse (its
text, once it is prepared no more), Bind (its parameters, as text) and Execute messages: a
parameter's value, such as a call's key, finds it in either case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

COMMIT = b"COMMIT\x00"
LOSE_REPLY = ("lose-commit-reply", "lose-reply")
READY_FOR_QUERY = b"Z\x00\x00\x00\x05"


@dataclass(eq=False)  # hashed by identity: kept in a set
class Link:
    """One client connection and its connection to the server."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    # Set once the COMMIT whose answer is lost went through: the server's answer is dropped.
    swallow: bool = False

    def close(self) -> None:
        for writer in (self.client, self.server):
            transport = writer.transport
            if not transport.is_closing():
                transport.abort()


@dataclass
class Proxy:
    target_host: str
    target_port: int
    links: set[Link] = field(default_factory=set)
    cut_until: float = 0.0
    # What to lose next: the mode, the text that finds the message, how many to let by first.
    armed: tuple[str, bytes, int] | None = None
    accepted: int = 0
    refused: int = 0
    commits_lost: int = 0
    statements_lost: int = 0

    async def serve_client(self, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self.cut_until:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host,
                                                                 self.target_port)
        except OSError:
            self.refused += 1
            writer.transport.abort()
            return
        self.accepted += 1
        link = Link(writer, up_writer)
        self.links.add(link)
        try:
            await asyncio.gather(self.client_to_server(reader, link),
                                 self.server_to_client(up_reader, link))
        finally:
            link.close()
            self.links.discard(link)

    async def client_to_server(self, reader: asyncio.StreamReader, link: Link) -> None:
        async for data in _chunks(reader):
            if self.armed is not None and self.armed[1] in data:
                mode, text, skip = self.armed
                if skip > 0:
                    self.armed = (mode, text, skip - 1)
                else:
                    self.armed = None
                    if text == COMMIT:
                        self.commits_lost += 1
                    else:
                        self.statements_lost += 1
                    if mode not in LOSE_REPLY:
                        break
                    link.swallow = True
            await _send(link.server, data)
        link.close()

    async def server_to_client(self, reader: asyncio.StreamReader, link: Link) -> None:
        async for data in _chunks(reader):
            if link.swallow:
                # The server has answered the COMMIT (it is durable now): drop the answer and
                # hang up on both sides.
                if READY_FOR_QUERY in data:
                    break
                continue
            await _send(link.client, data)
        link.close()

    def close_all(self) -> int:
        links = list(self.links)
        for link in links:
            link.close()
        return len(links)

    async def serve_control(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        while line := (await reader.readline()).decode().strip():
            command, _, arg = line.partition(" ")
            if command == "cut":
                self.cut_until = time.monotonic() + float(arg)
                reply = f"ok {self.close_all()}"
            elif command == "reset":
                reply = f"ok {self.close_all()}"
            elif command in ("lose-commit", "lose-commit-reply"):
                self.armed = (command, COMMIT, 0)
                reply = "ok"
            elif command in ("lose-reply", "lose-statement"):
                skip, _, text = arg.partition(" ")
                self.armed = (command, text.encode(), int(skip))
                reply = "ok"
            elif command == "stats":
                reply = (f"open {len(self.links)} accepted {self.accepted} "
                         f"refused {self.refused} commits-lost {self.commits_lost} "
                         f"statements-lost {self.statements_lost}")
            else:
                reply = f"error unknown command {command!r}"
            writer.write(reply.encode() + b"\n")
            await writer.drain()
        writer.close()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """What arrives on ``reader``, until it closes or fails."""
    while True:
        try:
            data = await reader.read(65536)
        except OSError:
            return
        if not data:
            return
        yield data


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    with contextlib.suppress(OSError):
        await writer.drain()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True, help="host:port of the real server")
    args = parser.parse_args()
    host, _, port = args.target.rpartition(":")
    proxy = Proxy(host, int(port))
    data = await asyncio.start_server(proxy.serve_client, "127.0.0.1", 0)
    control = await asyncio.start_server(proxy.serve_control, "127.0.0.1", 0)
    data_port = data.sockets[0].getsockname()[1]
    control_port = control.sockets[0].getsockname()[1]
    print(f"listening {data_port} control {control_port}", flush=True)
    async with data, control:
        await asyncio.gather(data.serve_forever(), control.serve_forever())


if __name__ == "__main__":
    asyncio.run(main())
