"""SQLite's hot path on the DB-API connection: the store's Core statements, compiled once.

A SQLite claim and finish cost 0.67 ms through SQLAlchemy's ``Connection.execute`` against
0.26 ms for the same statements sent to ``sqlite3`` directly (``python -m bench driver``): the
difference is SQLAlchemy's per-execution Python (its compiled cache lookup, the execution
context, the result object, the events), not SQLite. The statements a call runs on every
claim, move and insert go through :func:`run` instead: each Core statement is compiled once
for the connection's dialect into its SQL text, the order of its parameters, the values of
its fixed ones and the bind and result processors of its types, and then bound and sent on
the connection's own ``sqlite3`` cursor, whose statement cache keeps it prepared.

The statement still runs inside the transaction SQLAlchemy began on that connection (its
``BEGIN IMMEDIATE``, its commit or rollback, the pool, the hooks that run after commit), so
nothing about transactions changes. The statements are the same objects the other engine
runs, so there is one definition of each. A ``sqlite3`` error is raised as SQLAlchemy's
``DBAPIError`` subclass for it, as ``Connection.execute`` would raise it, so the retries
(``connections.retryable``) and the ``IntegrityError`` of a taken key behave as before.

PostgreSQL runs its hot path as one statement each (``moves.single_statement``), and
:func:`run` sends those on psycopg's connection the same way (:func:`_run_server`): there
SQLAlchemy's execution cost a worker child more CPU than the rest of a call's Python, mostly
in describing each whole-row result's columns (issue 29).
"""

from __future__ import annotations

import copy
import functools
import sqlite3
from collections import namedtuple
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError, StatementError

# The value of a slot that every execution must give (see ``Prepared.fixed``).
_REQUIRED = object()


class DriverRow:
    """What a prepared statement returns per row: attribute access by column name, and
    ``_mapping``, as the SQLAlchemy rows the rest of the store reads do."""

    __slots__ = ()

    @property
    def _mapping(self) -> dict[str, Any]:
        return self._asdict()  # type: ignore[attr-defined, no-any-return]


@dataclass(frozen=True)
class Prepared:
    """One Core statement compiled once for a dialect (SQLite's, or a server's positional
    copy: :func:`_positional`): its text, how its parameters are bound and how
    its returned rows are read."""

    sql: str
    # One slot per ``?``, in order: its parameter's name, and the value it takes when an
    # execution does not give that name (a literal's, a column default), or ``_REQUIRED``.
    # A given name overrides the value, as in SQLAlchemy's own execution.
    names: tuple[str, ...]
    fixed: tuple[Any, ...]
    # The bind processors of the parameters' types, by slot.
    binds: tuple[tuple[int, Callable[[Any], Any]], ...]
    # The result processors of the returned columns' types, by position, and the row type
    # (None: the statement returns nothing).
    results: tuple[tuple[int, Callable[[Any], Any]], ...]
    row: type | None
    # On a server: the returned columns' types, whose result processors need the type code
    # the server gives each column (a numeric's), and those processors once known.
    types: tuple[Any, ...] = ()
    resolved: list[tuple[tuple[int, Callable[[Any], Any]], ...]] = field(
        default_factory=list, compare=False, hash=False)

    def values(self, params: Mapping[str, Any]) -> list[Any]:
        """The positional values of one execution; ``KeyError`` names a missing parameter."""
        values = [params[name] if fixed is _REQUIRED or name in params else fixed
                  for name, fixed in zip(self.names, self.fixed, strict=True)]
        for i, process in self.binds:
            if values[i] is not None:
                values[i] = process(values[i])
        return values

    def rows(self, fetched: Sequence[tuple[Any, ...]],
             results: tuple[tuple[int, Callable[[Any], Any]], ...] | None = None) -> list[Any]:
        """The fetched tuples as rows of this statement's row type (``results``: the result
        processors, when not :attr:`results`)."""
        make = self.row._make  # type: ignore[union-attr]
        results = self.results if results is None else results
        if not results:
            return [make(r) for r in fetched]
        rows = []
        for raw in fetched:
            values = list(raw)
            for i, process in results:
                values[i] = process(values[i])
            rows.append(make(values))
        return rows


@functools.lru_cache(maxsize=512)
def prepare(statement: Any, dialect: Dialect, column_keys: tuple[str, ...] | None) -> Prepared:
    """``statement`` compiled once for ``dialect`` (SQLite's qmark style). ``column_keys``:
    the columns an INSERT is given, which decide its column list; the columns it is not given
    get their scalar Python defaults, as SQLAlchemy's execution would give them.
    ``TypeError`` for a statement that cannot be compiled once (an IN list expanded per
    execution, a default computed per row)."""
    compiled = statement.compile(dialect=dialect,
                                 column_keys=list(column_keys) if column_keys else None)
    if compiled.positiontup is None:
        raise TypeError(f"not a positional statement: {compiled.string[:80]!r}")
    defaults: dict[str, Any] = {}
    for column in compiled.insert_prefetch:
        if not (column.default is not None and column.default.is_scalar):
            raise TypeError(f"the default of {column.key!r} is computed per row")
        defaults[column.key] = column.default.arg
    fixed: list[Any] = []
    binds: list[tuple[int, Callable[[Any], Any]]] = []
    for i, name in enumerate(compiled.positiontup):
        bind = compiled.binds[name]
        if bind.expanding:
            raise TypeError(f"the parameter {name!r} expands per execution")
        required = bind.required or name in (column_keys or ())
        fixed.append(_REQUIRED if required else defaults.get(name, bind.effective_value))
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None:
            binds.append((i, process))
    results: list[tuple[int, Callable[[Any], Any]]] = []
    row: type | None = None
    returned = compiled.returning or (list(statement.selected_columns)
                                      if getattr(statement, "is_select", False) else None)
    types: tuple[Any, ...] = ()
    if returned:
        labels = [column.key for column in returned]
        types = tuple(column.type.dialect_impl(dialect) for column in returned)
        if dialect.name == "sqlite":  # no type codes there; a server's: _server_results
            for i, impl in enumerate(types):
                process = impl.result_processor(dialect, None)
                if process is not None:
                    results.append((i, process))
        row = type("DriverRow", (DriverRow, namedtuple("Columns", labels)), {"__slots__": ()})
    return Prepared(compiled.string, tuple(compiled.positiontup), tuple(fixed), tuple(binds),
                    tuple(results), row, types)


def _cursor(conn: Connection) -> sqlite3.Cursor:
    driver = conn.connection.driver_connection
    assert isinstance(driver, sqlite3.Connection)
    return driver.cursor()


def _raised(conn: Connection, sql: str, err: sqlite3.Error) -> StatementError:
    """``err`` as SQLAlchemy's exception for it (``OperationalError``, ``IntegrityError``,
    ...), as ``Connection.execute`` raises it."""
    return DBAPIError.instance(sql, None, err, sqlite3.Error, dialect=conn.dialect)


def run(conn: Connection, statement: Any, params: Mapping[str, Any]) -> list[Any]:
    """Run ``statement`` with ``params`` on ``conn`` and return its rows (empty for a
    statement that returns none), compiled once and sent on the DB-API connection: SQLite's
    ``sqlite3``, or PostgreSQL's psycopg (:func:`_run_server`). An INSERT sets the columns
    ``params`` names."""
    if conn.dialect.name != "sqlite":
        return _run_server(conn, statement, params)
    prepared = prepare(statement, conn.dialect,
                       tuple(sorted(params)) if _is_insert(statement) else None)
    values = prepared.values(params)
    cur = _cursor(conn)
    try:
        cur.execute(prepared.sql, values)
        fetched = cur.fetchall() if prepared.row is not None else []
    except sqlite3.Error as err:
        raise _raised(conn, prepared.sql, err) from err
    finally:
        cur.close()
    return prepared.rows(fetched) if fetched else []


def _run_server(conn: Connection, statement: Any, params: Mapping[str, Any]) -> list[Any]:
    """:func:`run` on a server's DB-API connection (psycopg).

    Through ``Connection.execute`` each execution also builds an execution context and a
    result, and psycopg describes every column of the result for it (``cursor.description``):
    for a call's whole row, 27 column objects a statement, about 40% of a worker child's
    CPU per call on PostgreSQL (issue 29). Here the statement is compiled once with ``%s``
    placeholders (:func:`_positional`) and its tuples are read as :class:`DriverRow` s.
    What ``Connection.execute`` does around the cursor is kept: the transaction is
    SQLAlchemy's (psycopg begins it on the first statement, or runs in autocommit as the
    connection was checked out), ``before_cursor_execute`` listeners see the statement, and
    an error goes through SQLAlchemy's own handling (the ``handle_error`` hooks, the
    connection invalidated when the server was lost), raised as ``Connection.execute``
    raises it, so the store's retries behave as before. A statement that cannot be compiled
    once (an IN list expanded per execution) runs through ``Connection.execute``."""
    try:
        prepared = prepare(statement, _positional(conn.dialect),
                           tuple(sorted(params)) if _is_insert(statement) else None)
    except TypeError:
        result = conn.execute(statement, dict(params))
        return list(result) if result.returns_rows else []
    values = prepared.values(params)
    cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        conn.dispatch.before_cursor_execute(conn, cur, prepared.sql, values, None, False)
        cur.execute(prepared.sql, values)
        fetched = cur.fetchall() if prepared.row is not None else []
        if fetched and not prepared.resolved:
            prepared.resolved.append(_server_results(prepared, conn.dialect, cur))
    except Exception as err:
        # SQLAlchemy's handling of a DB-API error, as Connection.execute runs it (raises):
        # the one place it lives, private to SQLAlchemy; tests/test_store_outages.py loses
        # the server under these statements, and fails if it moves.
        conn._handle_dbapi_exception(err, prepared.sql, values, cur, None)
        raise
    finally:
        cur.close()
    return prepared.rows(fetched, prepared.resolved[0]) if fetched else []


def _server_results(prepared: Prepared, dialect: Dialect,
                    cur: Any) -> tuple[tuple[int, Callable[[Any], Any]], ...]:
    """The result processors of ``prepared``'s columns, from the type codes its first
    result gave (what SQLAlchemy's execution reads from ``cursor.description`` each time)."""
    found = []
    for i, (impl, column) in enumerate(zip(prepared.types, cur.description, strict=True)):
        process = impl.result_processor(dialect, column.type_code)
        if process is not None:
            found.append((i, process))
    return tuple(found)


@functools.lru_cache(maxsize=8)
def _positional(dialect: Dialect) -> Dialect:
    """``dialect`` compiling positional ``%s`` placeholders (``format``, which psycopg takes
    as it takes ``pyformat``): :func:`prepare` binds values by position."""
    if dialect.positional:
        return dialect
    positional = copy.copy(dialect)
    positional.paramstyle = "format"
    positional.positional = True
    return positional


def run_text(conn: Connection, sql: str) -> None:
    """Run one SQL text with no parameters on SQLite's DB-API connection (the ``BEGIN`` and
    pragmas of every transaction), raising as ``Connection.exec_driver_sql`` would."""
    cur = _cursor(conn)
    try:
        cur.execute(sql)
    except sqlite3.Error as err:
        raise _raised(conn, sql, err) from err
    finally:
        cur.close()


def run_many(conn: Connection, statement: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """Run an INSERT that returns nothing once per row of ``rows`` (``executemany``), every
    row with the columns of the first: prepared on SQLite, ``conn.execute`` elsewhere."""
    if not rows:
        return
    if conn.dialect.name != "sqlite":
        conn.execute(statement, [dict(r) for r in rows])
        return
    prepared = prepare(statement, conn.dialect, tuple(sorted(rows[0])))
    batch = [prepared.values(r) for r in rows]
    cur = _cursor(conn)
    try:
        cur.executemany(prepared.sql, batch)
    except sqlite3.Error as err:
        raise _raised(conn, prepared.sql, err) from err
    finally:
        cur.close()


def _is_insert(statement: Any) -> bool:
    return bool(getattr(statement, "is_insert", False))
