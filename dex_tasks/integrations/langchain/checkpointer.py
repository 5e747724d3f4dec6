"""``DexCheckpointer``: LangGraph's checkpointer on the dex store."""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Sequence
from typing import Any, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from dex_tasks import AsyncDexClient, DexClient, InvalidArgumentError
from dex_tasks.integrations.langchain.serde import StrictSerializer


class DexCheckpointer(BaseCheckpointSaver[str]):
    """LangGraph's checkpointer on the dex store (SQLite or PostgreSQL), so that an agent
    needs no second database: ``create_agent(..., checkpointer=DexCheckpointer(client))``.

    Checkpoints and pending writes are serialised in LangGraph's msgpack form into
    ``dex_checkpoints`` and ``dex_checkpoint_writes``; every write is retried across a lost
    connection like the store's own. The async methods run the same code in a thread. Any
    process with a client on the same store resumes the thread.

    Loading a checkpoint never imports or calls a name the stored data chooses beyond
    LangGraph's safe types (messages, ``Send``, ``Interrupt``, ``Command``, dates, ...) and the
    types your graph's state holds, which you declare in ``allowed_types`` (classes, or
    ``(module, name)`` pairs): anything else is refused whole with
    :class:`~dex_tasks.integrations.langchain.UnsafeCheckpointError` (a value of an undeclared
    type is refused when it is stored, naming it). With ``LANGGRAPH_STRICT_MSGPACK=true``
    LangGraph also adds the types its state schema declares (``with_allowlist``). A ``serde``
    given is used as given, with whatever it allows.
    """

    def __init__(self, client: DexClient | AsyncDexClient, *,
                 allowed_types: Iterable[type | tuple[str, ...]] = (),
                 serde: SerializerProtocol | None = None) -> None:
        if serde is not None and allowed_types:
            raise InvalidArgumentError("give allowed_types or your own serde, not both: "
                                       "allowed_types configures DexCheckpointer's serializer")
        super().__init__(serde=serde or StrictSerializer(allowed_types))
        sync = _sync_client(client)
        self._store = sync.checkpoints

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]
                       ) -> DexCheckpointer:
        """This checkpointer allowing the types LangGraph derived from the graph's state schema
        as well (LangGraph calls it when ``LANGGRAPH_STRICT_MSGPACK`` is on)."""
        if not isinstance(self.serde, StrictSerializer):
            return cast(DexCheckpointer, super().with_allowlist(extra_allowlist))
        serde = self.serde.with_types(extra_allowlist)
        if serde is self.serde:
            return self
        clone = copy.copy(self)
        clone.serde = serde
        return clone

    # -- sync ---------------------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names (its ``checkpoint_id``), else the thread's newest."""
        conf = config["configurable"]
        found = self._store.get(str(conf["thread_id"]), conf.get("checkpoint_ns", ""),
                                get_checkpoint_id(config))
        return None if found is None else self._tuple(found)

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None,
             limit: int | None = None) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first: of ``config``'s thread (and namespace, if given), whose
        metadata has ``filter``'s values, older than ``before``, at most ``limit``."""
        conf = (config or {}).get("configurable") or {}
        thread_id = conf.get("thread_id")
        found = self._store.list(
            thread_id=None if thread_id is None else str(thread_id),
            checkpoint_ns=conf.get("checkpoint_ns"),
            checkpoint_id=get_checkpoint_id(config) if config else None,
            before=get_checkpoint_id(before) if before else None,
            limit=limit, metadata_filter=filter)
        for stored in found:
            yield self._tuple(stored)

    def put(self, config: RunnableConfig, checkpoint: Checkpoint,
            metadata: CheckpointMetadata, new_versions: ChannelVersions) -> RunnableConfig:
        """Save a checkpoint; returns the config that names it."""
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        checkpoint_ns = conf.get("checkpoint_ns", "")
        type_, blob = self.serde.dumps_typed(checkpoint)
        self._store.put(thread_id, checkpoint_ns, checkpoint["id"], conf.get("checkpoint_id"),
                        type_, blob, get_checkpoint_metadata(config, metadata))
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns,
                                 "checkpoint_id": checkpoint["id"]}}

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                   task_id: str, task_path: str = "") -> None:
        """Save a task's writes against the checkpoint ``config`` names."""
        conf = config["configurable"]
        stored = [(WRITES_IDX_MAP.get(channel, idx), channel, *self.serde.dumps_typed(value))
                  for idx, (channel, value) in enumerate(writes)]
        self._store.put_writes(str(conf["thread_id"]), conf.get("checkpoint_ns", ""),
                               str(conf["checkpoint_id"]), task_id, task_path, stored)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread."""
        self._store.delete_thread(str(thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Of each thread, keep the newest checkpoint of each namespace (``"keep_latest"``,
        with the ancestors its ``DeltaChannel`` values are rebuilt from), or delete them all
        (``"delete"``); their writes go with them."""
        self._store.prune(thread_ids, strategy)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write of a thread, every namespace, to another thread
        (a fork: the copy goes on independently)."""
        self._store.copy_thread(source_thread_id, target_thread_id)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete every checkpoint (and its writes) made by these runs (metadata ``run_id``)."""
        self._store.delete_for_runs(run_ids)

    def get_next_version(self, current: str | None, channel: None) -> str:
        """LangGraph's string versions (as its SQLite and in-memory savers make them)."""
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(current.split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"

    # -- async: the same, in a thread -------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """:meth:`get_tuple` in a thread."""
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(self, config: RunnableConfig | None, *,
                    filter: dict[str, Any] | None = None, before: RunnableConfig | None = None,
                    limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        """:meth:`list` in a thread."""
        found = await asyncio.to_thread(
            lambda: list(self.list(config, filter=filter, before=before, limit=limit)))
        for item in found:
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint,
                   metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        """:meth:`put` in a thread."""
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                          task_id: str, task_path: str = "") -> None:
        """:meth:`put_writes` in a thread."""
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        """:meth:`delete_thread` in a thread."""
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """:meth:`prune` in a thread."""
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """:meth:`copy_thread` in a thread."""
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """:meth:`delete_for_runs` in a thread."""
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    def _tuple(self, stored: Any) -> CheckpointTuple:
        # ``stored``: a dex_tasks.store.checkpoints.StoredCheckpoint
        ids = {"thread_id": stored.thread_id, "checkpoint_ns": stored.checkpoint_ns}
        return CheckpointTuple(
            config={"configurable": {**ids, "checkpoint_id": stored.checkpoint_id}},
            checkpoint=self.serde.loads_typed((stored.type or "", stored.checkpoint)),
            metadata=cast(CheckpointMetadata, stored.metadata),
            parent_config=({"configurable": {**ids,
                                             "checkpoint_id": stored.parent_checkpoint_id}}
                           if stored.parent_checkpoint_id else None),
            pending_writes=[(w.task_id, w.channel,
                             self.serde.loads_typed((w.type or "", w.value or b"")))
                            for w in stored.writes],
        )


def _sync_client(client: DexClient | AsyncDexClient) -> DexClient:
    if isinstance(client, AsyncDexClient):
        return client.sync
    if isinstance(client, DexClient):
        return client
    raise InvalidArgumentError(
        f"client must be a DexClient or an AsyncDexClient, got {type(client).__name__}")
