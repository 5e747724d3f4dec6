"""Logging set-up for the ``dex-tasks`` processes: JSON lines or readable text, secrets redacted.

Library code logs with a stable event name per action and its context in ``extra``::

    log.info("call claimed", extra={"action": "call_claimed", "key": key})

:func:`configure_logging` turns each record into one JSON object per line (``ts``, ``level``,
``logger``, ``message``, then every ``extra`` field) or into ``time LEVEL logger message
key=value ...`` text. Both formats pass every string through :func:`redact` first, so a
database URL with a password, a bearer token, an approval link's ``token=`` or the secret key
itself never reaches a log file, whoever logged it (our code, Celery, uvicorn).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

LogFormat = Literal["json", "text"]
FORMATS: tuple[LogFormat, ...] = ("json", "text")
REDACTED = "***"

# Every attribute a plain LogRecord has: whatever else is on a record came from ``extra``.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None))) | {
    "message", "asctime", "taskName",
    # uvicorn's copy of the message with ANSI colours: noise in a log file.
    "color_message",
}
# Field names whose values are secrets whatever they contain.
_SECRET_NAME = re.compile(r"secret|passw|token|authorization|api[_-]?key|credential", re.I)
# scheme://user:PASSWORD@host -> scheme://user:***@host (redis, postgres, amqp, http ...).
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^@/\s]+(?=@)")
# Authorization: Bearer X, ?token=X, &secret_key=X, password=X in free text.
_BEARER = re.compile(r"(?P<head>\bBearer\s+)[^\s\"',]+", re.I)
_QUERY_SECRET = re.compile(
    r"(?P<head>\b(?:token|secret(?:_key)?|password|passwd|api_key)=)[^&\s\"',]+", re.I
)

_secret_values: set[str] = set()


def add_secret(value: str) -> None:
    """Redact this exact value wherever it appears in a log line from now on."""
    # Very short values would redact ordinary words; settings validation keeps real keys long.
    if value and len(value) >= 6:
        _secret_values.add(value)


def redact(text: str) -> str:
    """``text`` with URL passwords, bearer tokens, ``token=`` values and known secrets masked."""
    for secret in _secret_values:
        if secret in text:
            text = text.replace(secret, REDACTED)
    text = _URL_PASSWORD.sub(rf"\g<head>{REDACTED}", text)
    text = _BEARER.sub(rf"\g<head>{REDACTED}", text)
    return _QUERY_SECRET.sub(rf"\g<head>{REDACTED}", text)


class RedactFilter(logging.Filter):
    """A filter that redacts a record's message and its string arguments in place.

    For loggers whose records reach handlers we do not own: uvicorn's access log, formatted by
    uvicorn's own ``AccessFormatter`` when uvicorn configures logging (``uvicorn --factory
    ...``), carries the request path, and so a page link's ``?token=``, in ``record.args``.
    The arguments keep their number and types, which that formatter unpacks.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {k: redact(v) if isinstance(v, str) else v
                           for k, v in record.args.items()}
        return True


def redact_logger(name: str) -> None:
    """Redact every record logged on logger ``name``, whatever handlers it reaches (the
    filter is added once however often this is called)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactFilter) for f in logger.filters):
        logger.addFilter(RedactFilter())


def _clean(name: str, value: Any) -> Any:
    """A JSON-ready copy of an ``extra`` value, redacted."""
    if _SECRET_NAME.search(name):
        return REDACTED
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {str(k): _clean(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_clean(name, v) for v in value]
    if hasattr(value, "get_secret_value"):  # pydantic SecretStr
        return REDACTED
    return redact(str(value))


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra`` fields a record carries (everything a plain LogRecord lacks), redacted."""
    return {
        name: _clean(name, value)
        for name, value in vars(record).items()
        if name not in _RECORD_FIELDS and not name.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message``, then the extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(
                timespec="milliseconds"
            ).replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
            "pid": record.process,
        }
        for name, value in extra_fields(record).items():
            # An extra may not overwrite the envelope: keep it under another name instead.
            entry[name if name not in entry else f"extra_{name}"] = value
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        elif record.exc_text:
            entry["exc"] = redact(record.exc_text)
        if record.stack_info:
            entry["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``2024-05-01 12:00:00,123 INFO logger message action=... key=...``, redacted.

    One record is one line: ids come from agents and may hold newlines or other control
    characters, which would otherwise forge or split log lines. They are escaped (``\\n``)
    in the message and in values; a value with spaces, quotes or ``=`` is quoted as JSON. Only
    a traceback, which is multi-line by nature, follows on lines of its own.
    """

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        message = escape_controls(redact(record.getMessage()))
        line = f"{self.formatTime(record)} {record.levelname} {record.name} {message}"
        extras = extra_fields(record)
        if record.name.startswith("celery"):
            # Celery's ``data`` repeats what its message already says; JSON lines keep it.
            extras.pop("data", None)
        if extras:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in extras.items())
        if record.exc_info:
            line += "\n" + redact(self.formatException(record.exc_info))
        elif record.exc_text:
            line += "\n" + redact(record.exc_text)
        if record.stack_info:
            line += "\n" + redact(self.formatStack(record.stack_info))
        return line


# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """``text`` with every control character written as an escape, so it stays on one line."""
    return _CONTROLS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


# What a terminal or a page must never be handed raw from user data: the controls above (ESC
# starts a terminal command: clear the screen, set the clipboard with OSC 52, retitle the
# window) and the bidirectional formatting characters, which reorder what is shown
# ("\u202e00001 :tnuoma" displays as "amount: 10000").
_BIDI_AND_C1 = r"\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(rf"[\x00-\x1f{_BIDI_AND_C1}]")
# In serialized JSON a raw C0 character can only be the whitespace between tokens: json.dumps
# escapes those in strings, not the others.
_UNSAFE_IN_JSON = re.compile(rf"[{_BIDI_AND_C1}]")


def visible(text: str) -> str:
    """``text`` with every control and bidirectional formatting character written as a
    visible escape (``\\x1b``, ``\\u202e``): what a terminal shows is what the text holds."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def json_visible(text: str) -> str:
    """Serialized JSON with those characters as ``\\uXXXX`` escapes: the same JSON value,
    safe to print (``json.dumps(..., ensure_ascii=False)`` leaves C1 and bidi ones raw)."""
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if not text or any(c in text for c in ' "=') or _CONTROLS.search(text):
        # JSON escapes C0 controls and quotes; the rest (DEL, C1, U+2028) is escaped after.
        return escape_controls(json.dumps(text, ensure_ascii=False))
    return text


def configure_logging(
    fmt: str = "text",
    level: str | int = "INFO",
    *,
    secrets: Iterable[str] = (),
    stream: TextIO | None = None,
) -> logging.Handler:
    """Send every log record of this process to ``stream`` (stderr) in ``fmt``.

    Replaces the root logger's handlers, so call it once at process start. ``secrets`` are
    exact values (the signing key) to mask wherever they appear. Returns the handler.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    for value in secrets:
        add_secret(value)
    # Keep a reference to the real stderr: Celery later swaps sys.stderr for a logging proxy,
    # and writing log lines into that proxy would loop.
    handler = logging.StreamHandler(stream or sys.__stderr__ or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # Warnings (Celery's "running as root", deprecations) become records too, not stray text.
    logging.captureWarnings(True)
    return handler


def take_over_celery_logging() -> None:
    """Stop Celery (worker and beat) from installing its own handlers over ours.

    Celery configures logging only when nobody answers its ``setup_logging`` signal; answering
    it keeps :func:`configure_logging`'s handler, which forked pool children inherit.
    """
    from celery import signals

    @signals.setup_logging.connect(weak=False)
    def _keep_ours(**_: Any) -> None:
        return None



def setup_process_logging(fmt: str, level: str, secret_key: str | None, *,
                          celery: bool) -> None:
    """What ``dex-tasks worker|beat|api`` do first: our handler, the signing key redacted,
    and (for Celery processes) Celery kept from replacing it."""
    configure_logging(fmt, level, secrets=[secret_key] if secret_key else [])
    if celery:
        take_over_celery_logging()
