"""What the end of a call says on Redis: its channels, its message, and the signed record it
hands waiters.

Both sides of the notifications use these: the sending side (``announce.py``, which publishes
each ended call's message after the commit that ended it) and the waiting side (``notify.py``,
whose watcher wakes the call's waiters with it).

* **The channels.** Each call has its own, ``dex:ended:<key>`` (:func:`ended_channel`); the
  end of each call is announced on its session's too, ``dex:ended:session:<id>``
  (:func:`session_channel`), prefixed by the call's key (:func:`session_message`).
* **The message.** The call's new status, then (after a space) its ended record (the columns
  of its ``ToolCallRecord``, as JSON text) signed with the key every process of the store
  shares (:class:`RecordSigner`), or the status alone (:func:`ended_message`). A waiter
  believes only a record that passes the signature check and names its call
  (:func:`ended_record`); anything else makes it read the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
from itsdangerous import BadData, Serializer, Signer
from itsdangerous.encoding import want_bytes

from dex_tasks.errors import DexError

if TYPE_CHECKING:
    from dex_tasks.store import EndedCall, Store

log = logging.getLogger("dex_tasks.broker.ended")

CHANNEL_PREFIX = "dex:ended:"
"""Prefix of the pub/sub channel of one call: ``dex:ended:<idempotency key>``."""


Connect = Callable[[float], redis.Redis]
"""Makes a Redis client whose socket and connect timeouts are the given seconds."""


def ended_channel(key: str) -> str:
    """The pub/sub channel the end of call ``key`` is announced on."""
    return CHANNEL_PREFIX + key


SESSION_CHANNEL_PREFIX = CHANNEL_PREFIX + "session:"
"""Prefix of the pub/sub channel where the ends of a session's calls are announced as well:
``dex:ended:session:<session id>``. A session id holds no ``/`` and a key always does, so no
call's channel is ever a session's; and it sits under :data:`CHANNEL_PREFIX`, so whatever
lets a process use the calls' channels (an ACL's channel pattern) lets it use these."""


def session_channel(session_id: str) -> str:
    """The pub/sub channel the ends of session ``session_id``'s calls are announced on."""
    return SESSION_CHANNEL_PREFIX + session_id


def session_message(key: str, message: str) -> str:
    """What the end of call ``key`` publishes on its session's channel: the key, prefixed by
    its length (an id may hold spaces and colons), then what the call's own channel says
    (:func:`ended_message`)."""
    return f"{len(key)}:{key}{message}"


def parse_session_message(data: str | bytes) -> tuple[str, str] | None:
    """``(key, message)`` of a :func:`session_message`, or None if it is not one."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", "surrogateescape")
    length, colon, rest = data.partition(":")
    if not colon or not length.isdigit() or int(length) > len(rest):
        return None
    size = int(length)
    return rest[:size], rest[size:]


RECORD_SALT = "dex-tasks.ended-record"
"""Salt of the signature of an ended record handed to waiters (apart from the tokens')."""

RECORD_KEY_NAME = "ended-records"
"""The store's shared key (``Store.shared_key``) ended records are signed with."""

KEY_RETRY_SECONDS = 30.0
"""How long a process whose store could not give it the key goes without signing or
believing records before it asks again."""

MAX_RECORD_CHARS = 32_000
"""An ended record longer than this (a large result) is not sent: its waiters read the
store."""


def record_serializer(key: str) -> Serializer[str]:
    """How ended records are signed and checked with ``key``: itsdangerous' ``Serializer``
    with its salt :data:`RECORD_SALT`, whose output (and what it accepts) is exactly that of
    ``Serializer(key, salt=RECORD_SALT)``, made cheaper to sign with (see
    :class:`_RecordSerializer`)."""
    return _RecordSerializer(key)


class _KeyedSigner(Signer):
    """itsdangerous' ``Signer``, whose key is derived once, not for every signature or check
    (a SHA1 of the salt and the secret each time)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._derived = super().derive_key()

    def derive_key(self, secret_key: str | bytes | None = None) -> bytes:
        # The newest secret's key is kept: signing asks for it (None), and a check asks for
        # each secret it tries by name (want_bytes: as itsdangerous compares them).
        if secret_key is None or want_bytes(secret_key) == self.secret_keys[-1]:
            return self._derived
        return super().derive_key(secret_key)


class _RecordSerializer(Serializer[str]):
    """itsdangerous' ``Serializer`` that makes its ``Signer`` once, instead of for every
    record it signs or checks: a worker child signs the record of every call it ends, and
    making the signer (and deriving its key, :class:`_KeyedSigner`) was about a fifth of the
    signing's CPU, more beside the announcement's round trip (issue 29)."""

    def __init__(self, key: str) -> None:
        super().__init__(key, salt=RECORD_SALT, signer=_KeyedSigner)
        # (A signer keeps nothing of what it signs: one serves every thread.)
        self._signer = super().make_signer()

    def make_signer(self, salt: str | bytes | None = None) -> Signer:
        # ``loads`` asks for the serializer's own salt by name.
        if salt is None or want_bytes(salt) == self.salt:
            return self._signer
        return super().make_signer(salt)


class RecordSigner:
    """Signs and checks ended records with the key every process of a store shares
    (``Store.shared_key(RECORD_KEY_NAME)``, read on first use), so they need no setting: a
    producer, its workers and beat find the same key in the store they share, and someone
    who can publish on Redis but not read the store cannot make a record a waiter believes.

    While the store cannot give the key (unreachable, or a schema from before it had keys)
    there is no signer: announcements carry only the status and waiters read the store, as
    they do for a lost notification; the key is asked for again after
    :data:`KEY_RETRY_SECONDS`."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._serializer: Serializer[str] | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def serializer(self) -> Serializer[str] | None:
        """The serializer, or None while the key cannot be read."""
        if self._serializer is None and time.monotonic() >= self._retry_at:
            with self._lock:
                if self._serializer is None and time.monotonic() >= self._retry_at:
                    try:
                        self._serializer = record_serializer(
                            self._store.shared_key(RECORD_KEY_NAME))
                    except DexError as err:
                        self._retry_at = time.monotonic() + KEY_RETRY_SECONDS
                        log.warning("the store's key for ended records cannot be read; "
                                    "waiters read the store until it can", extra={
                                        "action": "record_key_unavailable", "error": str(err)})
        return self._serializer


def ended_message(call: EndedCall, signer: Serializer[str] | None) -> str:
    """What the end of ``call`` publishes on its channel: its status, then (after a space)
    the ended record (``EndedCall.record``), signed, which its waiters take instead of
    reading the store; or only the status (no signer, a record the ending did not return, or
    one too large), which makes them read it."""
    if signer is None or call.record is None or len(call.record) > MAX_RECORD_CHARS:
        return call.status.value
    # The record is JSON text already: signed as it is, which is what ``signer.dumps`` gives
    # for the value it holds (``dumps`` writes the JSON text, then signs it so).
    signed = signer.make_signer().sign(call.record).decode("utf-8")
    text = f"{call.status.value} {signed}"
    return text if len(text) <= MAX_RECORD_CHARS else call.status.value


def message_status(message: str | bytes) -> str:
    """The status an end notification announces (its first word)."""
    if isinstance(message, bytes):
        message = message.decode("utf-8", "surrogateescape")
    return message.split(" ", 1)[0]


def ended_record(message: str | bytes | None, signer: Serializer[str] | None,
                 key: str) -> dict[str, Any] | None:
    """The ended record of call ``key`` a notification carried, if it is one, signed with the
    store's key, for that call and terminal; None otherwise (read the store). Redis is not
    trusted with a call's outcome: a message anyone could publish is checked first."""
    if signer is None or message is None:
        return None
    if isinstance(message, bytes):
        message = message.decode("utf-8", "surrogateescape")
    _, _, signed = message.partition(" ")
    if not signed:
        return None  # a bare status
    try:
        record = signer.loads(signed)
    except (BadData, ValueError):
        log.warning("a call's end notification failed its signature check; reading the store",
                    extra={"action": "ended_record_refused"})
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    return record


def redis_connector(redis_url: str) -> Connect:
    """How the notifier and the watcher reach Redis: ``connect(timeout)`` makes a client of
    ``redis_url`` with that socket and connect timeout."""

    def connect(timeout: float) -> redis.Redis:
        return redis.Redis.from_url(redis_url, socket_timeout=timeout,
                                    socket_connect_timeout=timeout)

    return connect
