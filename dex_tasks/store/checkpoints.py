"""LangGraph checkpoints in the store: what ``integrations.langchain.DexCheckpointer`` saves.

The store keeps checkpoints and pending writes as LangGraph serialised them (a type tag and
bytes) and never looks inside: the integration serialises and the store only upserts, reads
newest first, and deletes a thread. It imports no LangGraph, so the store layer stays free of
framework code. Tables: ``dex_checkpoints`` and ``dex_checkpoint_writes`` (``models.py``,
migration ``0007_checkpoints``), the shape of LangGraph's own SQLite saver.

Every write is an upsert, so it is safe to run again: each goes through the store's retry
across a lost connection (``StoreBase._retrying``), like the calls' own writes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, delete, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from dex_tasks.store.base import StoreBase
from dex_tasks.store.models import CheckpointRow, CheckpointWriteRow

CHECKPOINTS = CheckpointRow.__table__  # type: ignore[attr-defined]
WRITES = CheckpointWriteRow.__table__  # type: ignore[attr-defined]
_THREAD = ("thread_id", "checkpoint_ns", "checkpoint_id")


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

    def _insert(self, table: Any, rows: list[dict[str, Any]]) -> Any:
        dialect = postgresql if self.store.is_postgres else sqlite
        return dialect.insert(table).values(rows)

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
