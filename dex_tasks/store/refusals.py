"""Which store errors waiting cannot fix, and the one line that says what to do about each.

A server that is down, restarting, failing over or unreachable for a moment is worth waiting
for: the store retries such errors (``connections.retryable``) and processes that start
against them wait (``ops.cli_common.until_store_answers``). A server that answers and refuses
is not: a wrong password, a role or a database that does not exist, a host its
``pg_hba.conf`` does not let in, a pooler that refuses a startup parameter or keeps no
prepared statements. Retried, those only fill a log for ever with "trying again" while nothing
works; :func:`refusal` recognises them, so that they end the operation (and a starting
process) at once with :class:`~dex_tasks.errors.StoreRefusedError`.

libpq reports a failed connection without a SQLSTATE (psycopg's ``OperationalError`` carries
none), and PgBouncer 1.18 sends its own refusals with the generic ``08P01``: the server's own
words are what tell these cases apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# What a PostgreSQL URL looks like, for the fixes that say where the mistake is.
_URL_SHAPE = "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"


@dataclass(frozen=True)
class _Refusal:
    """One kind of refusal: how the server words it, what it is, and how to fix it."""

    pattern: re.Pattern[str]
    cause: str
    fix: Callable[[re.Match[str], bool], str]


def _auth_fix(_m: re.Match[str], _pooler: bool) -> str:
    return ("check the user name and password in DEX_DATABASE_URL (" + _URL_SHAPE + "), and "
            "behind PgBouncer that the user is in its auth_file with that password")


def _role_fix(m: re.Match[str], _pooler: bool) -> str:
    return (f"create the role (CREATE ROLE \"{m.group('name')}\" LOGIN PASSWORD '...') or "
            "fix the user name in DEX_DATABASE_URL")


def _database_fix(m: re.Match[str], _pooler: bool) -> str:
    name = m.group("name")
    return (f"create it (CREATE DATABASE \"{name}\", or createdb {name}) or fix the database "
            "name at the end of DEX_DATABASE_URL; behind PgBouncer, list it under "
            "[databases]")


def _startup_fix(m: re.Match[str], pooler: bool) -> str:
    name = m.group("name")
    if not pooler and name == "options":
        return ("a connection pooler is in front of the server (PgBouncer?): set "
                "DEX_STORE_POOLER=transaction, which sends no startup options (see "
                "docs/deploying.md, \"Behind a connection pooler\")")
    return (f"remove {name} from DEX_DATABASE_URL's query, or add it to the pooler's "
            "ignore_startup_parameters (per-role settings go in ALTER ROLE ... SET)")


def _prepared_fix(_m: re.Match[str], pooler: bool) -> str:
    if pooler:
        return ("the pooler hands each transaction another server session; report this: "
                "DEX_STORE_POOLER=transaction prepares no statements")
    return ("a transaction pooler is in front of the server (PgBouncer with pool_mode = "
            "transaction?): set DEX_STORE_POOLER=transaction, which prepares no statements "
            "on the server")


def _hba_fix(_m: re.Match[str], _pooler: bool) -> str:
    return ("add a line for this host, user and database to the server's pg_hba.conf (or "
            "fix DEX_DATABASE_URL), then reload the server")


def _login_fix(m: re.Match[str], _pooler: bool) -> str:
    return f"ALTER ROLE \"{m.group('name')}\" LOGIN, or use a role that may log in"


def _connect_fix(_m: re.Match[str], _pooler: bool) -> str:
    return "GRANT CONNECT ON DATABASE ... TO the role, or use a role that has it"


def _url_fix(_m: re.Match[str], _pooler: bool) -> str:
    return f"fix DEX_DATABASE_URL ({_URL_SHAPE}, options as ?name=value)"


def _ssl_fix(_m: re.Match[str], _pooler: bool) -> str:
    return ("fix sslmode (and sslrootcert) in DEX_DATABASE_URL's query to match the server's "
            "TLS set-up")


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_REFUSALS: tuple[_Refusal, ...] = (
    _Refusal(_rx(r"unsupported startup parameter:\s*(?P<name>[\w.]+)"),
             "refused a startup parameter", _startup_fix),
    _Refusal(_rx(r"prepared statement \"[^\"]+\" (does not exist|already exists)"),
             "lost a prepared statement between transactions", _prepared_fix),
    _Refusal(_rx(r"(password|sasl|\"?[\w-]+\"?) authentication failed|no password supplied|"
                 r"password is required"),
             "refused the login", _auth_fix),
    _Refusal(_rx(r"role \"(?P<name>[^\"]+)\" does not exist"), "has no such role", _role_fix),
    _Refusal(_rx(r"database \"(?P<name>[^\"]+)\" does not exist"), "has no such database",
             _database_fix),
    _Refusal(_rx(r"no such database: (?P<name>\S+)"), "has no such database",
             _database_fix),
    _Refusal(_rx(r"no pg_hba\.conf entry"), "does not let this host in", _hba_fix),
    _Refusal(_rx(r"role \"(?P<name>[^\"]+)\" is not permitted to log in"),
             "refused a role that may not log in", _login_fix),
    _Refusal(_rx(r"permission denied for database"), "refused the database", _connect_fix),
    _Refusal(_rx(r"invalid connection option|invalid (integer|sslmode|target_session_attrs) "
                 r"value|missing \"=\" after"),
             "could not use the connection settings", _url_fix),
    _Refusal(_rx(r"server does not support ssl, but ssl was required|certificate verify "
                 r"failed"),
             "could not agree on TLS", _ssl_fix),
)


def refusal(message: str, *, where: str, pooler: bool) -> str | None:
    """The one line to end with when ``message`` (a driver error's text) is a refusal that
    waiting cannot fix; None when it may be transient (or is not about connecting).

    ``where``: the store's URL without its password. ``pooler``: ``DEX_STORE_POOLER`` says a
    transaction pooler is in front (the fixes differ).
    """
    text = " ".join(message.split())
    for kind in _REFUSALS:
        found = kind.pattern.search(text)
        if found is not None:
            return (f"the store at {where} {kind.cause} ({_server_words(text)}): "
                    f"{kind.fix(found, pooler)}")
    return None


def _server_words(text: str) -> str:
    """What the server said, without libpq's "connection to server at ... failed:" prefix."""
    for marker in ("FATAL:", "ERROR:"):
        if marker in text:
            return text.rsplit(marker, 1)[1].strip()
    return text.removeprefix("connection failed: ").strip()
