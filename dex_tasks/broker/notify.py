"""Notifications when calls end: waiters wake at once instead of polling the store.

Two sides, both on Redis pub/sub, one channel per call (``dex:ended:<key>``); what a message
says, and how its record is signed, is in ``ended.py``:

* **Sending** (``announce.EndedNotifier``, in ``announce.py``): a hook on the store
  (``Store.on_calls_ended``) that, after every commit that ended calls, publishes each call's
  new status on its channel, with the ended row signed with the store's shared key
  (``ended.ended_message``, ``ended.RecordSigner``).
* **Waiting** (:class:`CallWatcher`, this module): one pub/sub connection per client, read by a
  background thread, shared by every ``wait`` of the client (sync and async). A
  waiter reads the store, subscribes to its call's channel and reads the store again on every
  wake-up (when its subscription is confirmed, when the connection is lost, and every
  ``wait_poll_seconds`` regardless) but the one that hands it the ended record, signed with
  the store's key. Anything else a notification says only means "read the store now"; the
  store stays the one source of truth, so a message that is lost (Redis down, a publish that
  failed, a subscription confirmed after the call ended) costs at most one poll interval,
  never a wrong answer.

The end of each call is announced on its session's channel too (``dex:ended:session:<id>``,
``ended.session_message``): a client that listens on a session before it records a call there
is sure to hear that call's end, so its ``wait`` reads nothing at all (see
:class:`CallWatcher`).

Why pub/sub and not a per-call list with ``BLPOP``: ``BLPOP`` needs no confirmation step, but it
holds one Redis connection per waiting call (an asyncio agent waiting on 40 calls at once holds
40), leaves a key per ended call in Redis until it expires, and wakes only one of several
waiters of the same call. Pub/sub costs one connection per client, and nothing in Redis when
nobody listens; the race it has (a call ending between the waiter's read and its subscription)
is closed by reading the store again once the subscription is confirmed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from dex_tasks.broker.ended import (
    CHANNEL_PREFIX,
    SESSION_CHANNEL_PREFIX,
    Connect,
    ended_channel,
    parse_session_message,
    session_channel,
)

log = logging.getLogger("dex_tasks.broker.notify")

# The watcher's connection: its reply timeout, how long its thread waits at most for Redis or
# a waiter before it looks at the time, how long it may hear nothing before it pings, and how
# long without any reply (pong included) before it takes the connection for dead and opens
# another.
_WATCHER_SOCKET_TIMEOUT = 5.0
_IDLE_WAIT_SECONDS = 1.0
_IDLE_PING_SECONDS = 5.0
_DEAD_AFTER_SECONDS = 15.0
_RECONNECT_FIRST_PAUSE = 0.05
_RECONNECT_MAX_PAUSE = 2.0

MAX_SESSIONS = 1_000
"""The most sessions whose channels one watcher listens on (:meth:`CallWatcher.sending`);
the one used longest ago is dropped for a new one."""

MAX_SENT = 10_000
"""The most sent calls one watcher keeps the end of until they are waited for
(:meth:`CallWatcher.sent`); a call dropped from them is waited for by reading the store."""

MAX_KEPT_CHARS = 8_000_000
"""The most characters of kept ends one watcher holds (a record may be up to
:data:`MAX_RECORD_CHARS`); the oldest sent calls are dropped beyond it."""



class Watch:
    """One waiter's interest in one call: woken (``wait`` returns True, ``on_wake`` runs) when
    the call's channel has news, the subscription is confirmed, or the connection changes."""

    def __init__(self, watcher: CallWatcher, key: str,
                 on_wake: Callable[[], None] | None, *, sent: bool = False) -> None:
        self.watcher = watcher
        self.key = key
        self.channel = ended_channel(key)
        self._on_wake = on_wake
        self._event = threading.Event()
        # The last message heard on the channel: a signed ended record, or a bare status.
        self.message: str | bytes | None = None
        # A watch of a call this client sent, heard on its session's channel and subscribed
        # to nothing of its own (CallWatcher.watch_sent).
        self.sent = sent

    @property
    def live(self) -> bool:
        """Whether notifications can reach this watch now (see :attr:`CallWatcher.live`)."""
        return self.watcher.live

    @property
    def covered(self) -> bool:
        """For a watch of a sent call: whether its end still cannot be missed (its session's
        subscription has held since the call was sent; see :meth:`CallWatcher.watch_sent`)."""
        return self.watcher.covers(self)

    def wake(self, message: str | bytes | None = None) -> None:
        """Wake the waiter (called from the watcher's thread), with what its channel said."""
        if message is not None:
            self.message = message
        self._event.set()
        if self._on_wake is not None:
            try:
                self._on_wake()
            except Exception:
                # e.g. the waiting coroutine's event loop has closed: nobody to wake.
                log.debug("a waiter's wake-up callback failed", exc_info=True)

    def wait(self, timeout: float) -> bool:
        """Block until woken or ``timeout``; True if woken. Clears the wake-up."""
        woken = self._event.wait(timeout)
        self._event.clear()
        return woken

    def close(self) -> None:
        """Stop watching (unsubscribes when this was the channel's last watch)."""
        self.watcher.release(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _wake_all(watches: Iterable[Watch]) -> None:
    """Wake waiters left without what they relied on (a dropped sent call, a lost session):
    they read the store. Called with the watcher's lock let go."""
    for watch in watches:
        watch.wake()


@dataclass
class _Sent:
    """A call this client sent while the ends of its session's calls reached the watcher."""

    session_id: str
    # The confirmation of the session's subscription the call was sent under (``_sessions``).
    confirmed: int
    # What the session's channel said of the call's end, once it has.
    message: str | None = None
    # Its waiters (``watch_sent``): never subscribed to the call's channel, woken by what its
    # session's channel says, or when that cannot be relied on any longer.
    watches: list[Watch] = field(default_factory=list)


class CallWatcher:
    """The waiting side: one Redis pub/sub connection, read by a background thread.

    redis-py's pub/sub objects must not be shared between threads, so only the watcher's thread
    touches its connection: waiters queue SUBSCRIBE / UNSUBSCRIBE requests, which the thread
    sends in the order they were made, and a waiter that needs a subscription now wakes the
    thread with a byte on a pipe of this process's own, which the thread waits on beside its
    connection (:meth:`_sleep`). (It once published to a channel of the thread's own instead:
    a second Redis connection per client, and a round trip, a message to parse and a
    thread's wake-up more on every ``wait`` that found its call still running.) The thread
    starts on first use, reconnects with backoff when the connection is lost, and then wakes
    every waiter (they poll the store quickly until it is back).

    A waiter reads the store before it subscribes, and again once subscribed, because the
    call may end between the two. A call this client sent itself needs neither read if the
    watcher already heard its session's ends when it was sent: ``call_tool`` asks
    :meth:`sending` (which subscribes to the session's channel, for the session's next calls
    if not for this one) and tells :meth:`sent`; the call's end is kept when the session's
    channel announces it, and :meth:`watch_sent` hands it to the waiter, however late the
    waiter comes. That holds only while the subscription has held since the call was sent:
    a lost connection or a dropped session sends the waiter back to the store.
    """

    def __init__(self, connect: Connect) -> None:
        self._connect = connect
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._watches: dict[str, list[Watch]] = {}
        self._requests: list[tuple[str, str]] = []
        self._thread: threading.Thread | None = None
        # The pipe a waiter wakes the thread with (made with the thread; a forked child's
        # copies of its parent's are its parent's business, never read or closed here).
        self._wake_pipe: tuple[int, int] | None = None
        # Subscribed with the calls' channels, so that the connection always has one (a
        # SUBSCRIBE of no channel is an error) and its confirmation says it is live.
        self._own_channel = f"dex:watcher:{uuid.uuid4().hex}"
        self._live = False
        self._failed = False  # a connection failed and no new one is up yet
        self._closed = False
        # The sessions whose channels this watcher listens on, least recently used first:
        # each one's confirmation on the current connection (a number never used again), or
        # None until it is confirmed.
        self._sessions: OrderedDict[str, int | None] = OrderedDict()
        self._confirmations = itertools.count(1)
        # The calls sent under a confirmed session (see ``sent``), oldest first, by key, and
        # the characters of the ends kept for them.
        self._sent: OrderedDict[str, _Sent] = OrderedDict()
        self._kept_chars = 0

    @property
    def live(self) -> bool:
        """Whether notifications can reach the waiters: the watcher is connected, or making
        its first connection (which ends in a wake-up either way: each subscription's
        confirmation, or every waiter woken when it fails). False while Redis is down."""
        return self._live or not self._failed

    def watch(self, key: str, on_wake: Callable[[], None] | None = None) -> Watch:
        """Start watching call ``key``; the caller reads the store after each wake-up and
        closes the watch when done (``with watcher.watch(key) as w: ...``)."""
        if self._pid != os.getpid():
            # A forked child cannot use its parent's thread or connection: start afresh.
            self._reset()
        watch = Watch(self, key, on_wake)
        with self._lock:
            if self._closed:
                raise RuntimeError("the call watcher is closed")
            self._start()
            watches = self._watches.setdefault(watch.channel, [])
            watches.append(watch)
            first = len(watches) == 1
            if first:
                self._requests.append(("subscribe", watch.channel))
        if first:
            self._poke()
        return watch

    def sending(self, session_id: str) -> int | None:
        """Called before a call of ``session_id`` is recorded: the confirmation that the ends
        of the session's calls reach this watcher now, to hand to :meth:`sent`, or None.

        Listens on the session's channel from now on if it did not (without waiting for
        that: the session's later calls find it confirmed), up to :data:`MAX_SESSIONS`."""
        if self._pid != os.getpid():
            return None  # a forked child: its first watch starts afresh
        channel = session_channel(session_id)
        dropped: set[str] = set()
        with self._lock:
            if self._closed:
                return None
            if session_id in self._sessions:
                self._sessions.move_to_end(session_id)
                return self._sessions[session_id] if self._live else None
            self._start()
            self._sessions[session_id] = None
            self._requests.append(("subscribe", channel))
            while len(self._sessions) > MAX_SESSIONS:
                old, _ = self._sessions.popitem(last=False)
                self._requests.append(("unsubscribe", session_channel(old)))
                dropped.add(old)
            # The waiters of calls sent in a dropped session read the store instead.
            orphaned = self._sent_in(dropped) if dropped else []
        self._poke()
        _wake_all(orphaned)
        return None

    def sent(self, key: str, session_id: str, confirmed: int | None) -> None:
        """Call ``key`` of ``session_id`` was recorded, under the confirmation
        :meth:`sending` gave (None: nothing is kept). Its end is kept when its session's
        channel announces it, until :meth:`watch_sent` hands it on (at most
        :data:`MAX_SENT` calls, the oldest dropped)."""
        if confirmed is None:
            return
        with self._lock:
            # (A new list: _forget hands back the dropped entry's own.)
            orphaned = list(self._forget(key))
            self._sent[key] = _Sent(session_id, confirmed)
            orphaned += self._trim()
        _wake_all(orphaned)

    def watch_sent(self, key: str,
                   on_wake: Callable[[], None] | None = None) -> Watch | None:
        """A watch of call ``key`` that needs no read of the store: this client sent the call
        (:meth:`sent`) while its session's ends reached the watcher, and they have reached it
        ever since, so its end cannot be missed. Its ``message`` is the end, if announced
        already; else it is woken with it. None if that does not hold (read the store)."""
        if self._pid != os.getpid():
            return None
        with self._lock:
            sent = self._sent.get(key)
            if sent is not None and self._covering(sent):
                watch = Watch(self, key, on_wake, sent=True)
                watch.message = sent.message
                sent.watches.append(watch)
                return watch
            orphaned = self._forget(key)
        _wake_all(orphaned)
        return None

    def covers(self, watch: Watch) -> bool:
        """Whether the end of ``watch``'s sent call still cannot be missed: the call is still
        kept, with this watch among its waiters (one dropped is not, even if the same key was
        sent again since), under the confirmation it was sent under."""
        with self._lock:
            sent = self._sent.get(watch.key)
            return (watch.sent and sent is not None and watch in sent.watches
                    and self._covering(sent))

    def _forget(self, key: str) -> list[Watch]:
        """Drop sent call ``key`` (under self._lock); its waiters, which the caller wakes once
        it has let the lock go: they find themselves no longer covered and read the store."""
        sent = self._sent.pop(key, None)
        if sent is None:
            return []
        if sent.message is not None:
            self._kept_chars -= len(sent.message)
        return sent.watches

    def _trim(self) -> list[Watch]:
        """Drop the oldest sent calls beyond the bounds (under self._lock); their waiters, to
        wake (see :meth:`_forget`)."""
        orphaned: list[Watch] = []
        while self._sent and (len(self._sent) > MAX_SENT
                              or self._kept_chars > MAX_KEPT_CHARS):
            orphaned += self._forget(next(iter(self._sent)))
        return orphaned

    def _sent_in(self, sessions: set[str]) -> list[Watch]:
        # Under self._lock: the waiters of the calls sent in ``sessions``.
        return [w for sent in self._sent.values() if sent.session_id in sessions
                for w in sent.watches]

    def _covering(self, sent: _Sent) -> bool:
        # Under self._lock. A confirmation is never given twice, so a session dropped or a
        # connection lost since (its confirmation then None or a newer one) does not match.
        return self._live and self._sessions.get(sent.session_id) == sent.confirmed

    def release(self, watch: Watch) -> None:
        """Forget ``watch``; unsubscribe its channel if no other watch needs it. (Nothing waits
        for that: the thread sends it with its next command, or within a second.)"""
        if watch.sent:
            with self._lock:
                sent = self._sent.get(watch.key)
                if sent is not None and watch in sent.watches:
                    sent.watches.remove(watch)
                    if not sent.watches:
                        self._forget(watch.key)  # waited for: its end is not kept any longer
            return
        with self._lock:
            watches = self._watches.get(watch.channel)
            if watches is None or watch not in watches:
                return
            watches.remove(watch)
            if not watches:
                del self._watches[watch.channel]
                self._requests.append(("unsubscribe", watch.channel))

    def close(self) -> None:
        """Stop the thread and close its connections (waits up to two seconds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None and self._pid == os.getpid():
            self._poke()
            thread.join(2.0)
            if not thread.is_alive() and self._wake_pipe is not None:
                # (Left open if the thread is still in its wait: closing a descriptor under
                # a poll is undefined, and a daemon thread ends with the process.)
                for fd in self._wake_pipe:
                    os.close(fd)
                self._wake_pipe = None

    def _start(self) -> None:
        # Under self._lock.
        if self._thread is None:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wake_pipe = (read, write)
            self._thread = threading.Thread(target=self._run, name="dex-call-watcher",
                                             daemon=True)
            self._thread.start()

    def _poke(self) -> None:
        """Wake the watcher's thread out of its wait, so it sends the queued commands now."""
        pipe = self._wake_pipe
        if pipe is None:
            return
        try:
            os.write(pipe[1], b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the thread has wake-ups enough waiting
        except OSError:
            log.debug("could not wake the call watcher", exc_info=True)

    def _wake(self, channel: str | None, message: str | bytes | None = None) -> None:
        with self._lock:
            if channel is None:
                watches = [w for ws in self._watches.values() for w in ws]
                watches += [w for sent in self._sent.values() for w in sent.watches]
            else:
                watches = list(self._watches.get(channel, ()))
                # (A message's channel: a sent call's watches are subscribed to nothing,
                # so there may be no watch here to take the key from.)
                sent = self._sent.get(channel.removeprefix(CHANNEL_PREFIX))
                if sent is not None:
                    watches += sent.watches
        for watch in watches:
            watch.wake(message)

    def _heard_session(self, kind: str, session_id: str, data: Any) -> None:
        """What a session's channel said: its subscription confirmed or ended, or the end of
        one of its calls, kept for the call's waiter if this client sent it."""
        if kind == "message":
            parsed = parse_session_message(data) if isinstance(data, str | bytes) else None
            if parsed is None:
                return
            key, message = parsed
            with self._lock:
                sent = self._sent.get(key)
                if sent is None or sent.session_id != session_id or sent.message is not None:
                    return  # a call this client did not send, or one waited for already
                sent.message = message
                self._kept_chars += len(message)
                woken = list(sent.watches)
                orphaned = self._trim()
            for watch in woken:
                watch.wake(message)
            _wake_all(orphaned)
            return
        with self._lock:
            if session_id not in self._sessions:
                return
            if kind == "subscribe":
                self._sessions[session_id] = next(self._confirmations)
                return
            # Unsubscribed (dropped, perhaps to be listened on again): what was sent under
            # its confirmation may have ended unheard. Those waiters read the store.
            self._sessions[session_id] = None
            orphaned = self._sent_in({session_id})
        _wake_all(orphaned)

    # -- the watcher's thread -------------------------------------------------------------------

    def _run(self) -> None:
        pause = _RECONNECT_FIRST_PAUSE
        failing = False
        while not self._closed:
            client = self._connect(_WATCHER_SOCKET_TIMEOUT)
            client.set_retry(Retry(NoBackoff(), 0))  # the loop below reconnects, not redis-py
            pubsub = client.pubsub()  # type: ignore[no-untyped-call]
            try:
                with self._lock:
                    channels = list(self._watches)
                    # A new connection: each session is confirmed anew, as it is subscribed.
                    for session_id in self._sessions:
                        self._sessions[session_id] = None
                        channels.append(session_channel(session_id))
                    self._requests.clear()  # the snapshot covers them
                pubsub.subscribe(self._own_channel, *channels)
                self._live = True
                self._failed = False
                if failing:
                    log.info("call watcher reconnected", extra={"action": "watcher_resumed"})
                failing = False
                pause = _RECONNECT_FIRST_PAUSE
                self._read(pubsub)
            except Exception as err:  # noqa: BLE001 - any failure: reconnect, waiters poll
                self._failed = True
                if not failing and not self._closed:
                    failing = True
                    log.warning("call watcher lost Redis; waits poll the store until it is "
                                "back", extra={"action": "watcher_failed",
                                               "error": f"{type(err).__name__}: {err}"})
            finally:
                self._live = False
                # Messages may have been missed: every waiter reads the store again.
                self._wake(None)
                try:
                    pubsub.close()
                    client.close()
                except Exception:  # noqa: BLE001 - closing a dead connection
                    pass
            if not self._closed:
                time.sleep(pause)
                pause = min(pause * 2, _RECONNECT_MAX_PAUSE)

    def _read(self, pubsub: Any) -> None:
        heard = pinged = time.monotonic()
        while not self._closed:
            self._send(pubsub)
            # What redis-py has already read comes first (a wait on the socket would not see
            # it); only when nothing is left does the thread wait, for Redis or a waiter.
            message = pubsub.get_message(timeout=0)
            if message is None:
                self._sleep(pubsub, _IDLE_WAIT_SECONDS)
                message = pubsub.get_message(timeout=0)
            now = time.monotonic()
            if message is None:
                if now - heard > _DEAD_AFTER_SECONDS:
                    raise ConnectionError(f"no reply from Redis for {now - heard:.0f}s")
                if now - heard > _IDLE_PING_SECONDS and now - pinged > _IDLE_PING_SECONDS:
                    pinged = now
                    pubsub.ping()
                continue
            heard = now
            kind = message.get("type")
            channel = message.get("channel")
            if isinstance(channel, bytes):
                channel = channel.decode("utf-8", "surrogateescape")
            if isinstance(channel, str) and channel.startswith(SESSION_CHANNEL_PREFIX):
                if kind in ("message", "subscribe", "unsubscribe"):
                    self._heard_session(str(kind), channel[len(SESSION_CHANNEL_PREFIX):],
                                        message.get("data"))
                continue
            if kind in ("message", "subscribe"):
                # A confirmed subscription wakes its waiters too: their call may have ended
                # before it, and they must read the store once more.
                data = message.get("data") if message.get("type") == "message" else None
                self._wake(str(channel), data if isinstance(data, str | bytes) else None)

    def _sleep(self, pubsub: Any, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for Redis to send something on the connection or a
        waiter to poke the thread (its byte is taken here)."""
        # kombu reads its pub/sub socket the same way, from redis-py's connection: there is
        # no public name for it. A connection with no socket was lost: the caller reconnects.
        sock = getattr(pubsub.connection, "_sock", None)
        pipe = self._wake_pipe
        if sock is None or pipe is None:
            raise redis.ConnectionError("the call watcher's connection is closed")
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        poller.register(pipe[0], select.POLLIN)
        for fd, _ in poller.poll(timeout * 1000):
            if fd == pipe[0]:
                with contextlib.suppress(BlockingIOError):
                    while os.read(pipe[0], 512):
                        pass

    def _send(self, pubsub: Any) -> None:
        """Send the queued requests in order; consecutive ones of a kind in one command, so a
        channel released and watched again ends subscribed."""
        with self._lock:
            batch, self._requests = self._requests, []
        run: list[str] = []
        for i, (kind, channel) in enumerate(batch):
            run.append(channel)
            if i + 1 == len(batch) or batch[i + 1][0] != kind:
                (pubsub.subscribe if kind == "subscribe" else pubsub.unsubscribe)(*run)
                run = []
