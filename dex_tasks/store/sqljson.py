"""JSON in the store: one column type for both engines, and how stored JSON is compared.

The library handles JSON columns (a call's arguments and result, event details, the catalog's
policies, hints and schemas) as *text*: canonical JSON (``registry.canonical_json``) going in,
JSON text coming out. :class:`JsonText` keeps it that way on both engines:

* SQLite: ``TEXT``, stored and read back unchanged.
* PostgreSQL: ``jsonb``, so psql users and ad-hoc SQL can query inside (``arguments->>'order_id'``)
  and an index can be built on a field. A value is parsed on its way in; on its way out the
  column is read as text (``col::text``, which keeps JSON ``null`` apart from SQL ``NULL``) and
  re-serialised canonically, so code and tests see the same text as on SQLite.

jsonb keeps values, not text: object keys come back in its own order (re-sorted here), and a
number keeps its value but not its spelling (``1e+20`` comes back as ``100000000000000000000``).
So two JSON texts are compared by value (:func:`same_json`), never as strings.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from sqlalchemy import Text, cast, type_coerce
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


def canonical_text(value: Any) -> str:
    """JSON with sorted keys and no spaces: the text the store hands back for ``value``."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


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
        parsed = _storable(json.loads(value))
        return JSON.NULL if parsed is None else parsed

    def column_expression(self, colexpr: ColumnElement[Any]) -> ColumnElement[Any]:
        # Read as text: the driver would otherwise parse jsonb, and JSON null and SQL NULL
        # would both arrive as None. A no-op on SQLite's TEXT.
        return type_coerce(cast(colexpr, Text), self)

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        if value is None or dialect.name != "postgresql":
            return value  # type: ignore[no-any-return]
        return canonical_text(json.loads(value))


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
