"""JSON in the store: one column type for both engines, and how stored JSON is compared.

The library handles JSON columns (a call's arguments and result, event details, the catalog's
policies, hints and schemas) as *text*: canonical JSON (``registry.canonical_json``) going in,
JSON text coming out. :class:`JsonText` keeps it that way on both engines:

* SQLite: ``TEXT``, stored and read back unchanged.
* PostgreSQL: ``jsonb``, so psql users and ad-hoc SQL can query inside (``arguments->>'order_id'``)
  and an index can be built on a field. A value is parsed on its way in; on its way out the
  column is read as text (``col::text``, which keeps JSON ``null`` apart from SQL ``NULL``) and
  re-serialised canonically, so code and tests see the same text as on SQLite. The statements
  of the hot path (a call's insert, a one-statement move) send their JSON as text instead,
  cast to jsonb by the server (:func:`jsonb_text`), with the same backstop for text not
  checked before.

jsonb keeps values, not text: object keys come back in its own order (re-sorted here), and a
number keeps its value but not its spelling (``1e+20`` comes back as ``100000000000000000000``).
So two JSON texts are compared by value (:func:`same_json`), never as strings.
"""

from __future__ import annotations

import functools
import json
from decimal import Decimal
from typing import Any

from sqlalchemy import Text, bindparam, cast, type_coerce
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import JSON, TypeDecorator, TypeEngine

from dex_tasks.limits import storable_text


def _storable(value: Any) -> Any:
    """``value`` with every string jsonb cannot hold (NUL, a lone surrogate) made holdable.

    Arguments and results are refused with such strings before they get here
    (``registry.json_problem``); this is the backstop for diagnostics (an event's detail
    quoting a tool's error message), where a replacement character beats a transition that
    fails and leaves its call stuck.
    """
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value


# What json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False) writes, with
# its encoder made once: json.dumps makes one per call when given options, about 1.1 µs of each
# JSON value read back on PostgreSQL (a call's arguments: 4.8 against 3.7 µs, issue 29). An
# encoder keeps no state between calls: one serves every thread.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


def canonical_text(value: Any) -> str:
    """JSON with sorted keys and no spaces: the text the store hands back for ``value``."""
    return _CANONICAL.encode(value)


def _parsed(text: str) -> Any:
    """The value of JSON ``text``, its strings made holdable by jsonb (:func:`_storable`)."""
    return _storable(json.loads(text))


def storable_json(text: str) -> str:
    """JSON ``text`` as jsonb can take it when cast there: ``text`` itself, or the canonical
    text of its value with every string jsonb cannot hold made holdable (:func:`_storable`).

    In JSON text a NUL or a lone surrogate is a ``\\u`` escape or, for a surrogate, a
    character outside ASCII (a raw NUL is not JSON: the server refuses it, as ``json.loads``
    did). So ASCII text without ``\\u`` (what ``json.dumps`` writes by default, of strings
    with nothing to escape) is returned as it is, unparsed: the column type's parse and
    psycopg's second ``json.dumps`` were what binding it cost (see :func:`jsonb_text`).
    Text that is not JSON is left for the server to refuse, or raises ``ValueError`` here.
    """
    if text.isascii() and "\\u" not in text:
        return text
    return canonical_text(_parsed(text))


class _StorableJson(TypeDecorator[str]):
    """JSON text bound as ``TEXT`` through :func:`storable_json` (see :func:`jsonb_text`)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else storable_json(value)


def jsonb_text(name: str, *, checked: bool = False) -> ColumnElement[Any]:
    """PostgreSQL: the bound parameter ``name``, JSON text, sent as text and cast to jsonb by
    the server (which parses it), instead of bound as a :class:`JsonText` column, which
    parses it here and has psycopg write it out again.

    The text goes through :func:`storable_json`, the backstop :class:`JsonText` applies to
    what it binds, unless ``checked``: text already canonical and refused when jsonb could
    not hold it (``registry.canonical_json``). SQL NULL (None) stays NULL and the text
    ``null`` is JSON null, as with :class:`JsonText`; text that is not JSON is refused by the
    server (a ``DataError``) where the column type raised ``ValueError``.
    """
    return cast(bindparam(name, type_=Text() if checked else _StorableJson()), JSONB)


class JsonText(TypeDecorator[str]):
    """A JSON column whose Python value is JSON text: ``TEXT`` on SQLite, ``jsonb`` on
    PostgreSQL (see the module docstring)."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            # none_as_null: SQL NULL stays NULL; JSON null is bound as JSON.NULL below.
            return dialect.type_descriptor(JSONB(none_as_null=True))
        return dialect.type_descriptor(Text())

    def process_bind_param(self, value: str | None, dialect: Dialect) -> Any:
        if value is None or dialect.name != "postgresql":
            return value
        parsed = _parsed(value)
        return JSON.NULL if parsed is None else parsed

    def column_expression(self, colexpr: ColumnElement[Any]) -> ColumnElement[Any]:
        # Read as text: the driver would otherwise parse jsonb, and JSON null and SQL NULL
        # would both arrive as None. A no-op on SQLite's TEXT.
        return type_coerce(cast(colexpr, Text), self)

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        if value is None or dialect.name != "postgresql":
            return value  # type: ignore[no-any-return]
        if len(value) <= _SHORT_TEXT:
            return _canonical_short(value)
        return canonical_text(json.loads(value))


# A short JSON text read back is usually one read many times (a tool's ``{}`` arguments, a
# ``null`` result, each of a worker's calls read and then returned by its ending): its
# canonical text is remembered instead of parsed and written out again for every row
# (issue 29). Only short texts, so the memory it holds stays small.
_SHORT_TEXT = 128


@functools.lru_cache(maxsize=1024)
def _canonical_short(text: str) -> str:
    """:func:`canonical_text` of the JSON ``text`` (a pure function of it, so remembered)."""
    return canonical_text(json.loads(text))


def same_json(stored: str, given: str) -> bool:
    """True if two JSON texts hold the same value: equal text, or equal after parsing.

    Parsed values compare as JSON does (jsonb's equality): numbers by the decimal value their
    text spells (``1`` and ``1.0`` alike, ``1e+23`` and ``100000000000000000000000`` alike, as
    jsonb keeps them), booleans never equal to numbers (Python's ``True == 1`` is
    not JSON's), objects by their keys and values, arrays in order.
    """
    return stored == given or _equal(json.loads(stored), json.loads(given))


def _number(value: int | float) -> Decimal:
    """A JSON number's exact value, as jsonb keeps it: the decimal its text spells.

    A float is compared by its shortest text (``repr``, what ``json.dumps`` writes), not by
    its binary value: ``1e23`` is stored by jsonb as exactly 10**23, which comes back as an
    int, while the float 1e23 is 99999999999999991611392 in binary, so ``==`` said they
    differ and a repeated call raised ConflictError.
    """
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return _number(a) == _number(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
