"""Typed settings, read once from the environment (``DEX_`` prefix) and passed around."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dex_tasks.errors import ConfigurationError
from dex_tasks.logs import redact


class DexSettings(BaseSettings):
    """Everything dex-tasks can be configured with.

    Each field reads the environment variable ``DEX_<FIELD NAME IN CAPITALS>``.
    """

    # An empty variable means "not set": compose files pass optional settings through as
    # ${DEX_X:-}, which must not turn a file path or a token into "".
    model_config = SettingsConfigDict(env_prefix="DEX_", extra="ignore", env_ignore_empty=True)

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Celery broker and claim keys: redis://, rediss:// (TLS) or "
        "sentinel://host:port;sentinel://host:port (Redis Sentinel).",
    )
    redis_sentinel_master: str | None = Field(
        default=None,
        description="The master name the Sentinels monitor (required with sentinel://).",
    )
    redis_tls_ca_file: str | None = Field(
        default=None,
        description="CA certificate (PEM) that signed Redis's TLS certificate (rediss://); "
        "default: the system's trusted CAs.",
    )
    redis_tls_cert_file: str | None = Field(
        default=None,
        description="Client certificate (PEM) for a Redis that requires one (rediss://).",
    )
    redis_tls_key_file: str | None = Field(
        default=None,
        description="Private key (PEM) of DEX_REDIS_TLS_CERT_FILE.",
    )
    database_url: str = Field(
        default="sqlite:///dex_tasks.db",
        description="The store: sqlite:///path or postgresql+psycopg://....",
    )
    secret_key: SecretStr | None = Field(
        default=None,
        description="Signs approval tokens; required by the API and `token` (no default: "
        "a public default would let anyone forge tokens). `demo` makes its own.",
    )
    lease_seconds: float = Field(
        default=30.0, gt=0,
        description="How long a running call's lease lasts without renewal.",
    )
    end_commit_hold_seconds: float = Field(
        default=0.002, ge=0, le=0.05,
        description="How long a worker process may hold a call's ending to commit it with "
                    "the endings of its other threads (group commit); only while other calls "
                    "run in the process. 0 commits each ending alone.",
    )
    store_retry_seconds: float = Field(
        default=5.0, ge=0,
        description="How long a transition, claim or lease renewal keeps retrying across a "
                    "lost database connection or a busy database before it gives up. Keep "
                    "it below lease_seconds.",
    )
    republish_after_seconds: float = Field(
        default=300.0, gt=0,
        description="A queued call with no delivery for this long is republished.",
    )
    republish_lost_after_seconds: float = Field(
        default=15.0, gt=0,
        description="A queued call whose message Redis no longer holds (in no queue, not "
        "unacknowledged, not claimed: lost in transit to a host a partition cut off) is "
        "republished once it is this old, instead of after republish_after_seconds.",
    )
    visibility_timeout_seconds: int = Field(
        default=3600, gt=0,
        description="Redis transport visibility timeout; must exceed the longest task.",
    )
    publish_timeout_seconds: float = Field(
        default=2.0, gt=0,
        description="How long call_tool may try to reach the broker before it gives up.",
    )
    claim_ttl_seconds: int = Field(
        default=30 * 24 * 3600, gt=0,
        description="TTL of the Redis claim key of a single-attempt call while it has not "
                    "ended.",
    )
    claim_ended_ttl_seconds: int = Field(
        default=60, gt=0,
        description="What is left of a single-attempt call's Redis claim once the call has "
                    "ended (the store's ended record refuses a second claim by itself, so Redis "
                    "keeps claims of calls in flight, not of a month's calls).",
    )
    sweep_interval_seconds: float = Field(
        default=10.0, gt=0,
        description="How often beat runs the sweeps.",
    )
    trace_tool_content: bool = Field(
        default=False,
        description="With OpenTelemetry tracing on: record each call's arguments and result on "
        "its execute_tool span (gen_ai.tool.call.arguments / .result). Off: never.",
    )
    catalog_cache_seconds: float = Field(
        default=5.0, ge=0,
        description="How long call_tool caches a tool's catalog entry (0: never).",
    )
    default_max_attempts: int = Field(
        default=3, ge=1,
        description="Attempts of a retrying call when its policy sets none.",
    )
    retry_backoff_base_seconds: float = Field(
        default=1.0, ge=0,
        description="First retry delay; doubled per attempt, with jitter.",
    )
    retry_backoff_max_seconds: float = Field(
        default=60.0, ge=0,
        description="Cap on the retry delay.",
    )
    tools: str | None = Field(
        default=None,
        description="Tool modules (a.b,c) the worker imports when --tools is not given.",
    )
    secrets_dir: Path | None = Field(
        default=None,
        description="A folder of secret files named like the variables (DEX_SECRET_KEY, "
        "DEX_DATABASE_URL, ...), as Docker and Kubernetes mount them; a set variable wins.",
    )
    max_event_streams: int = Field(
        default=1000, ge=1,
        description="Event streams (GET /sessions/{id}/events) one API process keeps open at "
        "once; a stream past it gets 429.",
    )
    max_event_streams_per_token: int = Field(
        default=10, ge=1,
        description="Event streams one token may keep open at once on one API process (a "
        "person's tabs); a stream past it gets 429.",
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="Bearer token GET /metrics requires (give it to Prometheus); unset, "
        "/metrics answers 401.",
    )
    state_dir: Path = Field(
        default_factory=lambda: default_state_dir(),
        description="Where beat keeps its schedule file (default: "
        "$XDG_STATE_HOME/dex-tasks, else ~/.local/state/dex-tasks).",
    )
    queue_deadline_seconds: float = Field(
        default=300.0, gt=0,
        description="A queued call whose tool no live worker serves ends 'did not run' after "
        "waiting this long (its expires_in instead, when the call gave one).",
    )
    worker_heartbeat_seconds: float = Field(
        default=2.0, gt=0,
        description="How often a worker announces its tools and held messages in Redis; "
        "after 5 missed beats it counts as gone.",
    )
    prune_batch: int = Field(
        default=1000, ge=1,
        description="Calls (or messages) `prune` deletes per transaction; workers wait for "
        "at most one batch.",
    )
    # -- bounded recovery under network partitions (docs/recovery.md) --------------------------
    store_keepalive_idle_seconds: int = Field(
        default=5, ge=1,
        description="PostgreSQL connections: TCP keepalive probes start after this much idle "
        "time (client side, and the server's toward the client).",
    )
    store_keepalive_interval_seconds: int = Field(
        default=2, ge=1, description="PostgreSQL connections: seconds between keepalive probes.",
    )
    store_keepalive_count: int = Field(
        default=3, ge=1,
        description="PostgreSQL connections: unanswered keepalive probes before the "
        "connection counts as dead.",
    )
    store_tcp_user_timeout_seconds: float = Field(
        default=10.0, gt=0,
        description="PostgreSQL connections: data unacknowledged this long ends the "
        "connection (TCP_USER_TIMEOUT, both sides), so nothing hangs in retransmission.",
    )
    store_connect_timeout_seconds: int = Field(
        default=10, ge=1,
        description="PostgreSQL connections: how long a connect may wait for the server.",
    )
    store_idle_in_transaction_seconds: float = Field(
        default=10.0, gt=0,
        description="PostgreSQL sessions: the server ends one that sits this long inside a "
        "transaction without running a statement, freeing the locks of a client that "
        "vanished mid-transaction (idle_in_transaction_session_timeout, set per session).",
    )
    store_pooler: Literal["none", "transaction"] = Field(
        default="none",
        description="What stands between dex-tasks and PostgreSQL: none (the server itself, "
        "or a session pooler that passes startup options through), or transaction (a "
        "transaction pooler such as PgBouncer with pool_mode = transaction: no startup "
        "options, no session state, no server-side prepared statements).",
    )
    sweep_statement_timeout_seconds: float = Field(
        default=20.0, gt=0,
        description="Statement timeout of the sweeps' and the lease renewals' transactions.",
    )
    sweep_lock_timeout_seconds: float = Field(
        default=2.0, gt=0,
        description="Lock timeout (SQLite: busy timeout) of the sweeps' and the lease "
        "renewals' transactions: they fail fast and try again instead of queueing.",
    )
    redis_health_check_seconds: int = Field(
        default=5, ge=0,
        description="A pooled Redis connection idle this long is checked with PING before "
        "use and replaced if dead (0: never).",
    )
    claim_retry_seconds: float = Field(
        default=10.0, ge=0,
        description="How long a worker keeps retrying the Redis claim of a single-attempt "
        "call on fresh connections before it leaves the call to the republisher.",
    )
    wait_poll_seconds: float = Field(
        default=1.0, gt=0,
        description="How often wait reads the store while Redis notifications work (a safety "
        "net for a lost notification; without Redis it polls every 5-200 ms).",
    )

    # -- webhooks (approvals that reach people; see dex_tasks/webhooks.py) --
    webhook_urls: str | None = Field(
        default=None,
        description="Comma-separated URLs told when a call awaits approval, is decided, or "
        "nears its deadline (set it where calls are made and decided: agents, API, beat).",
    )
    webhook_secret: SecretStr | None = Field(
        default=None,
        description="Signs webhook bodies (Dex-Signature, HMAC-SHA256); required by the "
        "workers that deliver them.",
    )
    webhook_deadline_lead_seconds: float = Field(
        default=3600.0, gt=0,
        description="approval_deadline_near is sent this long before a deadline.",
    )
    webhook_max_attempts: int = Field(
        default=12, ge=1, description="Delivery attempts of a webhook before it is failed.",
    )
    webhook_backoff_seconds: int = Field(
        default=2, ge=1,
        description="First retry delay of a webhook (whole seconds); Celery doubles it per "
        "attempt, with full jitter.",
    )
    webhook_backoff_max_seconds: int = Field(
        default=600, ge=1, description="Cap on a webhook's retry delay (whole seconds).",
    )
    webhook_timeout_seconds: float = Field(
        default=10.0, gt=0,
        description="Total deadline of one webhook delivery attempt: connecting, sending and "
        "reading the whole answer (a receiver that hangs or trickles is cut off then).",
    )
    webhook_concurrency: int = Field(
        default=16, ge=1,
        description="Webhook requests a worker's main process sends at once (deliveries never "
        "use the pool's slots).",
    )
    public_url: str | None = Field(
        default=None,
        description="The API's public base URL (https://dex.example.com), for webhooks' page "
        "links.",
    )

    def webhook_url_list(self) -> tuple[str, ...]:
        """``DEX_WEBHOOK_URLS`` as a tuple (empty when unset)."""
        return tuple(u.strip() for u in (self.webhook_urls or "").split(",") if u.strip())

    def __init__(self, **values: Any) -> None:
        # pydantic's own error is a dozen lines naming the field (lease_seconds), not the
        # variable the user set (DEX_LEASE_SECONDS): one line per mistake, saying what to put.
        # Docker and Kubernetes secrets are files (/run/secrets/DEX_SECRET_KEY): with
        # DEX_SECRETS_DIR set, each setting without its variable is read from the file of
        # that name there (a variable still wins).
        secrets = values.pop("_secrets_dir", None) or os.environ.get("DEX_SECRETS_DIR") or None
        if secrets is not None and not Path(secrets).is_dir():
            raise ConfigurationError(f"DEX_SECRETS_DIR={str(secrets)!r} is not a directory: point "
                                     "it at the folder of secret files (e.g. /run/secrets)")
        try:
            super().__init__(_secrets_dir=secrets, **values)
        except ValidationError as err:
            raise ConfigurationError(describe_errors(err)) from None

    @field_validator("database_url")
    @classmethod
    def _usable_database_url(cls, url: str) -> str:
        return check_database_url(url)

    def signing_key(self) -> str:
        """The token-signing secret; :class:`ConfigurationError` when it is not set."""
        value = self.secret_key.get_secret_value() if self.secret_key is not None else ""
        if not value:
            raise ConfigurationError(
                "DEX_SECRET_KEY is not set: it signs approval tokens, and there is no default "
                "(anyone could forge tokens with a public one). Set it to a long random value, "
                "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value


POSTGRES_EXTRA = 'pip install -e ".[postgres]" in the dex-tasks checkout'
"""How to install the PostgreSQL driver, as the README's Install section says (dex-tasks is not
on PyPI yet: a checkout, or the wheel built from one, with ``[postgres]``)."""

_STORE_URLS = "sqlite:///relative/path.db, sqlite:////absolute/path.db or " \
    "postgresql+psycopg://user:password@host:5432/dbname"


def sqlite_file(url: str) -> Path | None:
    """The file a ``sqlite://`` URL names, resolved against this process's folder (as the
    driver resolves it); None for another store or an in-memory SQLite."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.startswith("sqlite"):
        return None
    path = rest[1:].split("?", 1)[0] if rest.startswith("/") else ""
    if not path or path == ":memory:":
        return None
    return Path(path) if path.startswith("/") else Path.cwd() / path


def absolute_sqlite_url(url: str, folder: Path) -> str:
    """``url`` with a relative SQLite path made absolute against ``folder`` (so that every
    process, whatever its folder, opens the same file); any other URL as it is."""
    scheme, _, rest = url.partition("://")
    if scheme.startswith("sqlite") and rest.startswith("/") and rest[1:2] not in ("/", "", ":"):
        return f"{scheme}:///{(folder / rest[1:]).resolve()}"
    return url


def check_database_url(url: str) -> str:
    """``url`` if the store can use it; else a ``ValueError`` saying what to write instead."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"is not a URL: use {_STORE_URLS}")
    if scheme in {"postgres", "postgresql"}:
        raise ValueError(f"names no driver: use postgresql+psycopg://{rest} (the psycopg 3 "
                         f"driver: {POSTGRES_EXTRA})")
    if scheme.startswith("postgresql+psycopg") and scheme != "postgresql+psycopg2":
        try:
            import psycopg  # noqa: F401  (only to learn whether the extra is installed)
        except ImportError:
            raise ValueError("is a PostgreSQL URL, but its driver is not installed: "
                             f"{POSTGRES_EXTRA}") from None
        return url
    if scheme.startswith("sqlite"):
        if rest and not rest.startswith("/"):
            raise ValueError(f"has two slashes: a SQLite URL has three before a relative path "
                             f"({scheme}:///{rest}) and four before an absolute one "
                             f"({scheme}:////path/to/{Path(rest).name})")
        return url
    if scheme.startswith("postgresql"):
        return url  # another PostgreSQL driver the user installed and chose
    raise ValueError(f"has scheme {scheme}://, which the store does not support: use "
                     f"{_STORE_URLS}")


_KINDS = {float: "a number", int: "a whole number", bool: "true or false", Path: "a path"}


def describe_errors(err: ValidationError) -> str:
    """One line per wrong setting: its variable, the value, what is wrong and what to set."""
    lines = []
    for error in err.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        field = DexSettings.model_fields.get(name)
        variable = f"DEX_{name.upper()}"
        secret = field is not None and field.annotation in (SecretStr, SecretStr | None)
        shown = "" if secret or "input" not in error else f"={error['input']!r}"
        message = str(error["msg"]).removeprefix("Value error, ")
        hint = ""
        kind = _KINDS.get(field.annotation) if field is not None else None  # type: ignore[arg-type]
        if field is not None and kind is not None:
            about = (field.description or "").rstrip(".")
            hint = f"; set it to {kind} ({about}; default {field.get_default()})"
        joiner = " " if message.startswith(("is ", "has ", "names ")) else ": "
        # A URL's password, a token: never echoed back (the line may end up in a log).
        lines.append(redact(f"{variable}{shown}{joiner}{message}{hint}"))
    return "\n".join(lines)


def default_state_dir() -> Path:
    """The per-user state directory of the XDG base directory spec, for dex-tasks."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return Path(base) / "dex-tasks"


def settings_lines(settings: DexSettings) -> list[str]:
    """Each setting for ``dex-tasks config``: ``DEX_NAME=value`` (secrets only as set or not,
    URLs without their passwords; "(default)" when the environment does not set it), then its
    description, indented."""
    lines = []
    for name, field in DexSettings.model_fields.items():
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            shown = "(set)"
        elif value is None:
            shown = "(not set)"
        else:
            shown = redact(str(value))
        variable = f"DEX_{name.upper()}"
        default = "" if variable in os.environ else "  (default)"
        lines += [f"{variable}={shown}{default}", f"    {field.description}"]
    return lines
