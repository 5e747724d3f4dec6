"""How long ids and names may be, and the checks every one of them passes before it is stored.

The store's columns have these widths (``models.py`` takes them from here). PostgreSQL refuses a
longer value (which a client would see as a store error), and SQLite stores it but it can never
be read back into a model: one such row used to break every sweep that read it. So ids are
checked up front, with an error that names the field and the limit. NUL bytes (PostgreSQL text
cannot hold them) and lone surrogates (not encodable as UTF-8) are refused the same way.
"""

from __future__ import annotations

import hashlib

from dex_tasks.errors import DexError, InvalidArgumentError, InvalidCallError

SESSION_ID_MAX = 200
TURN_ID_MAX = 200
TOOL_CALL_ID_MAX = 200
KEY_MAX = 512
TOOL_NAME_MAX = 200
INTERRUPT_ID_MAX = 64
APPROVER_MAX = 200
# How deep a tool's result may nest (lists and objects). Deeper JSON is refused before it is
# written: Python's own JSON encoder, the store's bind processing and every reader recurse, and
# a result some of them cannot take left its call running with no ending recorded.
RESULT_DEPTH_MAX = 200

_REPLACEMENT = "\ufffd"


def text_problem(text: str) -> str | None:
    """What keeps the store from holding ``text`` (a NUL character, which PostgreSQL refuses
    even escaped in jsonb; a lone surrogate, which UTF-8 cannot encode), or None.

    The one check behind every text dex-tasks stores: ids, messages, arguments, results and
    the HTTP bodies, so a value behaves the same whichever store it lands in.
    """
    if "\x00" in text:
        return "contains a NUL character (\\x00), which the store cannot hold"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate, which is not valid Unicode"
    return None


def storable_text(text: str) -> str:
    """``text`` with what the store cannot hold (:func:`text_problem`) replaced by U+FFFD.

    For diagnostics the store records but nobody chose (a tool's error message, an event's
    detail): a replacement character beats a write that fails and leaves its call stuck.
    """
    if "\x00" in text:
        text = text.replace("\x00", _REPLACEMENT)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join(_REPLACEMENT if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text)
    return text


def check_text(field: str, value: object, *, error: type[DexError] = InvalidArgumentError) -> str:
    """``value`` if it is a string the store can hold (no NUL, valid Unicode); else ``error``."""
    if not isinstance(value, str):
        raise error(f"{field} must be a string, got {type(value).__name__}")
    problem = text_problem(value)
    if problem:
        raise error(f"{field} {problem}, got {_show(value)}")
    return value


def check_id(
    field: str, value: object, limit: int, *, slash: bool = True,
    error: type[DexError] = InvalidArgumentError,
) -> str:
    """``value`` if it is a non-empty id of at most ``limit`` characters the store can hold.

    ``slash=False`` refuses ``/``, which separates the parts of an idempotency key.
    """
    text = check_text(field, value, error=error)
    if not text:
        raise error(f"{field} must be a non-empty string, got {text!r}")
    if len(text) > limit:
        raise error(f"{field} must be at most {limit} characters, got {len(text)}")
    if not slash and "/" in text:
        raise error(f"{field} may not contain '/', got {_show(text)}")
    return text


def _show(value: str, width: int = 60) -> str:
    # Ids can be long and hold control characters: show a bounded, escaped form.
    shown = value if len(value) <= width else value[:width] + "..."
    return ascii(shown)


# key_part: a framework id is escaped ("~" then two hex digits for "~", "/" and control
# characters, "~u" and four for a lone surrogate) and used as it is when that is short enough;
# otherwise a readable prefix, "~~" and a hash of the whole id. An escaped id never holds "~~",
# so the two forms never meet, and escaping is one-to-one: two different ids never give one
# part (long ones only on a SHA-256 collision).
KEY_PART_MAX = 160
_KEY_PART_PREFIX = 100


def _escape_char(c: str) -> str:
    code = ord(c)
    if 0xD800 <= code <= 0xDFFF:
        return f"~u{code:04x}"
    if c in "~/" or code < 0x20 or code == 0x7F:
        return f"~{code:02x}"
    return c


def key_part(value: str) -> str:
    """The part of an idempotency key for a framework's id (a thread, run, message or
    tool-call id), the same for the same id and different for different ids.

    An id of ordinary characters is its own part; ``~``, ``/``, control characters and lone
    surrogates are escaped (``~2f`` for ``/``); an id whose escaped form is over 160
    characters becomes its first characters, ``~~`` and 32 hex digits of its SHA-256. Every
    part is a valid key part (:func:`idempotency_key`), three of them within the key's limit.
    """
    if not isinstance(value, str) or not value:
        raise InvalidCallError(f"a framework id must be a non-empty string, got {value!r}")
    escaped = "".join(_escape_char(c) for c in value)
    if len(escaped) <= KEY_PART_MAX:
        return escaped
    prefix = ""
    for c in value:
        piece = _escape_char(c)
        if len(prefix) + len(piece) > _KEY_PART_PREFIX:
            break
        prefix += piece
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{prefix}~~{digest}"
