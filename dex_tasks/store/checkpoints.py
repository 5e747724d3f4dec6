"""LangGraph checkpoints in the store: what ``integrations.langchain.DexCheckpointer`` saves.

The store keeps checkpoints and pending writes as LangGraph serialised them (a type tag and
bytes) and never looks inside: the integration serialises and the store only upserts, reads
newest first, and deletes a thread. It imports no LangGraph, so the store layer stays free of
framework code. Tables: ``dex_checkpoints`` and ``dex_checkpoint_writes`` (``models.py``,
migration ``0007_checkpoints``), the shape of LangGraph's own SQLite saver.

Every write is an upsert, so it is safe to run again: each goes through the store's retry
across a lost connection (``StoreBase._retrying``), like the calls' own writes.

Besides LangGraph's base operations the store serves its extended ones, as LangGraph's
conformance suite defines them: ``prune`` (``keep_latest``: the newest checkpoint of each
namespace; ``delete``: all), ``copy_thread`` and ``delete_for_runs``. ``keep_latest`` also
keeps the ancestors a ``DeltaChannel`` needs to rebuild its value (the checkpoint's metadata
says how many supersteps ago each channel's last snapshot was), which it reads from the
metadata alone. ``dex-tasks prune`` uses the same rule for the threads it trims.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, delete, func, literal, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from dex_tasks.errors import InvalidArgumentError
from dex_tasks.store.base import StoreBase
from dex_tasks.store.models import CheckpointRow, CheckpointWriteRow

CHECKPOINTS = CheckpointRow.__table__  # type: ignore[attr-defined]
WRITES = CheckpointWriteRow.__table__  # type: ignore[attr-defined]
_THREAD = ("thread_id", "checkpoint_ns", "checkpoint_id")
# A checkpoint's identity: (thread id, namespace, checkpoint id).
Ids = tuple[str, str, str]
STRATEGIES = ("keep_latest", "delete")


@dataclass(frozen=True)
class StoredWrite:
    """One pending write of a task, as LangGraph serialised its value."""

    task_id: str
    channel: str
    type: str | None
    value: bytes | None
    task_path: str = ""
    idx: int = 0


@dataclass(frozen=True)
class StoredCheckpoint:
    """One checkpoint as stored, with the pending writes made against it."""

    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_checkpoint_id: str | None
    type: str | None
    checkpoint: bytes
    metadata: dict[str, Any]
    writes: list[StoredWrite] = field(default_factory=list)


class Checkpoints:
    """Checkpoint reads and writes on a store (``client.checkpoints``)."""

    def __init__(self, store: StoreBase) -> None:
        self.store = store

    # -- writes ---------------------------------------------------------------------------------

    def put(self, thread_id: str, checkpoint_ns: str, checkpoint_id: str,
            parent_checkpoint_id: str | None, type_: str | None, checkpoint: bytes,
            metadata: Mapping[str, Any]) -> None:
        """Save a checkpoint (replacing one of the same thread, namespace and id)."""
        row = {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns,
               "checkpoint_id": checkpoint_id, "parent_checkpoint_id": parent_checkpoint_id,
               "type": type_, "checkpoint": checkpoint,
               # ensure_ascii: PostgreSQL text holds no NUL, and JSON escapes it.
               "metadata": json.dumps(dict(metadata), ensure_ascii=True, default=str),
               "created_at": time.time()}
        stmt = self._insert(CHECKPOINTS, [row])
        stmt = stmt.on_conflict_do_update(
            index_elements=list(_THREAD),
            set_={name: stmt.excluded[name] for name in
                  ("parent_checkpoint_id", "type", "checkpoint", "metadata", "created_at")})
        self.store.writing(lambda conn: conn.execute(stmt))

    def put_writes(self, thread_id: str, checkpoint_ns: str, checkpoint_id: str,
                   task_id: str, task_path: str,
                   writes: Sequence[tuple[int, str, str | None, bytes | None]]) -> None:
        """Save a task's pending writes, each ``(idx, channel, type, value)``, against a
        checkpoint, in one transaction.

        A write at a negative index (LangGraph's special channels: an error, an interrupt, a
        resume) replaces one stored under the same task and index; any other is kept as first
        stored, so a task that runs again cannot change what it wrote the first time.
        """
        if not writes:
            return
        keys = [*_THREAD, "task_id", "idx"]
        statements = []
        for special in (True, False):
            rows = [{"thread_id": thread_id, "checkpoint_ns": checkpoint_ns,
                     "checkpoint_id": checkpoint_id, "task_id": task_id, "idx": idx,
                     "task_path": task_path, "channel": channel, "type": type_,
                     "value": value}
                    for idx, channel, type_, value in writes if (idx < 0) is special]
            if not rows:
                continue
            stmt = self._insert(WRITES, rows)
            statements.append(stmt.on_conflict_do_update(
                index_elements=keys,
                set_={name: stmt.excluded[name] for name in
                      ("task_path", "channel", "type", "value")})
                if special else stmt.on_conflict_do_nothing(index_elements=keys))

        def op(conn: Connection) -> None:
            for stmt in statements:
                conn.execute(stmt)
        self.store.writing(op)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and pending write of a thread."""
        def op(conn: Connection) -> None:
            conn.execute(delete(WRITES).where(WRITES.c.thread_id == thread_id))
            conn.execute(delete(CHECKPOINTS).where(CHECKPOINTS.c.thread_id == thread_id))
        self.store.writing(op)

    def prune(self, thread_ids: Sequence[str], strategy: str = "keep_latest") -> int:
        """LangGraph's ``prune``: of each thread, keep the newest checkpoint of each namespace
        (and the ancestors its ``DeltaChannel``s rebuild from), or delete all
        (``"delete"``); their writes go with them. Returns how many checkpoints went."""
        if strategy not in STRATEGIES:
            raise InvalidArgumentError(f"strategy must be one of {', '.join(STRATEGIES)}, "
                                       f"got {strategy!r}")
        threads = sorted({str(t) for t in thread_ids})
        if not threads:
            return 0

        def op(conn: Connection) -> int:
            rows = thread_rows(conn, threads)
            kept = set() if strategy == "delete" else keep_latest(rows)
            return delete_checkpoints(conn, [row_ids(r) for r in rows
                                             if row_ids(r) not in kept])[0]
        return self.store.writing(op)

    def delete_for_runs(self, run_ids: Sequence[str]) -> int:
        """LangGraph's ``delete_for_runs``: every checkpoint whose metadata names one of these
        runs (``run_id``), in every thread and namespace, with its writes."""
        runs = sorted({str(r) for r in run_ids})
        if not runs:
            return 0
        stmt = select(*(CHECKPOINTS.c[name] for name in _THREAD)).where(
            self._json_field("run_id").in_(runs))

        def op(conn: Connection) -> int:
            return delete_checkpoints(conn, [tuple(r) for r in conn.execute(stmt).all()])[0]
        return self.store.writing(op)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> int:
        """LangGraph's ``copy_thread``: every checkpoint and write of one thread, every
        namespace, under another thread id (ids, parents, metadata and values as they are;
        what the target already holds under the same ids is kept). Returns how many
        checkpoints the source has."""
        source, target = str(source_thread_id), str(target_thread_id)

        def copy(table: Any) -> Any:
            names = [c.name for c in table.columns]
            picked = select(*(literal(target).label(n) if n == "thread_id" else table.c[n]
                              for n in names)).where(table.c.thread_id == source)
            stmt = self._insert_from(table, names, picked)
            return stmt.on_conflict_do_nothing(
                index_elements=[c.name for c in table.primary_key.columns])

        count = select(func.count()).select_from(CHECKPOINTS).where(
            CHECKPOINTS.c.thread_id == source)

        def op(conn: Connection) -> int:
            if source == target:
                return int(conn.execute(count).scalar_one())
            conn.execute(copy(CHECKPOINTS))
            conn.execute(copy(WRITES))
            return int(conn.execute(count).scalar_one())
        return self.store.writing(op)

    def _json_field(self, name: str) -> Any:
        """The metadata's top-level ``name`` as text, in SQL (metadata is JSON text)."""
        if self.store.is_postgres:
            return func.jsonb_extract_path_text(
                CHECKPOINTS.c.metadata.cast(postgresql.JSONB), name)
        return func.json_extract(CHECKPOINTS.c.metadata, f"$.{name}")

    def _insert(self, table: Any, rows: list[dict[str, Any]]) -> Any:
        dialect = postgresql if self.store.is_postgres else sqlite
        return dialect.insert(table).values(rows)

    def _insert_from(self, table: Any, names: list[str], picked: Any) -> Any:
        dialect = postgresql if self.store.is_postgres else sqlite
        return dialect.insert(table).from_select(names, picked)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, thread_id: str, checkpoint_ns: str,
            checkpoint_id: str | None = None) -> StoredCheckpoint | None:
        """The checkpoint ``checkpoint_id`` of the thread, or its newest one; None if none."""
        found = self.list(thread_id=thread_id, checkpoint_ns=checkpoint_ns,
                          checkpoint_id=checkpoint_id, limit=1)
        return found[0] if found else None

    def list(self, *, thread_id: str | None = None, checkpoint_ns: str | None = None,
             checkpoint_id: str | None = None, before: str | None = None,
             limit: int | None = None,
             metadata_filter: Mapping[str, Any] | None = None) -> list[StoredCheckpoint]:
        """Checkpoints newest first (by id: LangGraph's ids are time-ordered), with their writes.

        ``before`` keeps those whose id sorts before it; ``metadata_filter`` those whose
        metadata has each of its keys with that value (compared as JSON values).
        """
        stmt: Select[Any] = select(CHECKPOINTS)
        for name, value in (("thread_id", thread_id), ("checkpoint_ns", checkpoint_ns),
                            ("checkpoint_id", checkpoint_id)):
            if value is not None:
                stmt = stmt.where(CHECKPOINTS.c[name] == value)
        # Ids compare byte by byte, as LangGraph's savers compare them (PostgreSQL's default
        # collation would sort by locale rules).
        ordered = (CHECKPOINTS.c.checkpoint_id.collate("C") if self.store.is_postgres
                   else CHECKPOINTS.c.checkpoint_id)
        if before is not None:
            stmt = stmt.where(ordered < before)
        stmt = stmt.order_by(ordered.desc(), CHECKPOINTS.c.thread_id,
                             CHECKPOINTS.c.checkpoint_ns)
        if limit is not None and not metadata_filter:
            stmt = stmt.limit(limit)

        def read(conn: Connection) -> list[StoredCheckpoint]:
            found = []
            for row in conn.execute(stmt).mappings():
                metadata = json.loads(row["metadata"])
                if metadata_filter and not _matches(metadata, metadata_filter):
                    continue
                found.append(StoredCheckpoint(
                    thread_id=row["thread_id"], checkpoint_ns=row["checkpoint_ns"],
                    checkpoint_id=row["checkpoint_id"],
                    parent_checkpoint_id=row["parent_checkpoint_id"], type=row["type"],
                    checkpoint=bytes(row["checkpoint"]), metadata=metadata))
                if limit is not None and len(found) >= limit:
                    break
            writes = _writes_of(conn, found)
            return [StoredCheckpoint(**{**c.__dict__, "writes": writes.get(_ids(c), [])})
                    for c in found]

        return self.store.reading(read)


def _ids(c: StoredCheckpoint) -> tuple[str, str, str]:
    return (c.thread_id, c.checkpoint_ns, c.checkpoint_id)


def _matches(metadata: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    # Compared as JSON values, the way they were stored (a tuple in a filter is a list here).
    return all(key in metadata and metadata[key] == json.loads(json.dumps(value, default=str))
               for key, value in wanted.items())


def _writes_of(conn: Connection, checkpoints: Iterable[StoredCheckpoint],
               ) -> dict[tuple[str, str, str], list[StoredWrite]]:
    """The pending writes of each checkpoint, in LangGraph's order (task path, task, index)."""
    ids = [_ids(c) for c in checkpoints]
    if not ids:
        return {}
    cols = tuple_(*(WRITES.c[name] for name in _THREAD))
    stmt = select(WRITES).where(cols.in_(ids))
    grouped: dict[tuple[str, str, str], list[StoredWrite]] = {}
    for row in conn.execute(stmt).mappings():
        grouped.setdefault((row["thread_id"], row["checkpoint_ns"], row["checkpoint_id"]),
                           []).append(StoredWrite(
            task_id=row["task_id"], channel=row["channel"], type=row["type"],
            value=None if row["value"] is None else bytes(row["value"]),
            task_path=row["task_path"], idx=row["idx"]))
    # Sorted here, not by SQL: the order is Python's string order, whatever the collation.
    for writes in grouped.values():
        writes.sort(key=lambda w: (w.task_path, w.task_id, w.idx))
    return grouped


# -- keeping and deleting, for prune ------------------------------------------------------------


def row_ids(row: Any) -> Ids:
    return (row.thread_id, row.checkpoint_ns, row.checkpoint_id)


def thread_rows(conn: Connection, thread_ids: Sequence[str]) -> list[Any]:
    """Every checkpoint of these threads, without its bytes: ids, parent, metadata, time."""
    return list(conn.execute(
        select(CHECKPOINTS.c.thread_id, CHECKPOINTS.c.checkpoint_ns,
               CHECKPOINTS.c.checkpoint_id, CHECKPOINTS.c.parent_checkpoint_id,
               CHECKPOINTS.c.metadata, CHECKPOINTS.c.created_at)
        .where(CHECKPOINTS.c.thread_id.in_(thread_ids))).all())


def delta_depth(metadata_text: str) -> int | None:
    """How many ancestors a checkpoint's ``DeltaChannel`` values are rebuilt from: LangGraph's
    ``counters_since_delta_snapshot`` gives each channel's ``(updates, supersteps)`` since its
    last snapshot; the most supersteps, plus one to be safe; 0 without delta channels; None
    (every ancestor) if the metadata cannot be read."""
    try:
        counters = json.loads(metadata_text).get("counters_since_delta_snapshot") or {}
        if not counters:
            return 0
        return 1 + max(int(pair[1]) for pair in counters.values())
    except (ValueError, TypeError, AttributeError, IndexError, KeyError):
        return None


def keep_latest(rows: Iterable[Any]) -> set[Ids]:
    """What ``keep_latest`` keeps of these checkpoints: in each thread and namespace the newest
    (ids are time-ordered, compared byte by byte), and the ancestors its ``DeltaChannel``
    values are rebuilt from (:func:`delta_depth`)."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        groups.setdefault((row.thread_id, row.checkpoint_ns), {})[row.checkpoint_id] = row
    kept: set[Ids] = set()
    for by_id in groups.values():
        newest = by_id[max(by_id, key=lambda i: i.encode("utf-8", "surrogatepass"))]
        depth = delta_depth(newest.metadata)
        row, hops = newest, 0
        while row is not None and (depth is None or hops <= depth):
            kept.add(row_ids(row))
            row, hops = by_id.get(row.parent_checkpoint_id or ""), hops + 1
    return kept


def delete_checkpoints(conn: Connection, ids: Sequence[Ids], chunk: int = 500,
                       ) -> tuple[int, int]:
    """Delete these checkpoints and their writes; ``(checkpoints, writes)`` deleted."""
    deleted = [0, 0]
    for start in range(0, len(ids), chunk):
        part = list(ids[start:start + chunk])
        for n, table in ((1, WRITES), (0, CHECKPOINTS)):
            cols = tuple_(*(table.c[name] for name in _THREAD))
            deleted[n] += int(conn.execute(delete(table).where(cols.in_(part))).rowcount or 0)
    return deleted[0], deleted[1]
