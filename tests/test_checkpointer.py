"""``DexCheckpointer``: LangGraph's checkpointer on the dex store, on SQLite and PostgreSQL.

Conformance is judged against LangGraph's own reference saver, ``InMemorySaver``: the same
operations (put, put_writes with ordinary and special channels, get_tuple by id and latest,
list with filter / before / limit / namespace / no config, delete_thread, async variants) must
give the same answers. Then a real graph checkpoints into it and a second process, with a
client of its own, reads the state the first one left.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from langgraph.checkpoint.base import (
    ERROR,
    INTERRUPT,
    BaseCheckpointSaver,
    CheckpointTuple,
    create_checkpoint,
    empty_checkpoint,
)
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from dex_tasks import DexClient
from dex_tasks.integrations.langchain import DexCheckpointer
from tests.conftest import fast_settings, settings_env
from tests.helpers import ROOT


def conf(thread: str, ns: str = "", checkpoint_id: str | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": ns}
    if checkpoint_id is not None:
        c["checkpoint_id"] = checkpoint_id
    return {"configurable": c}


def plain(t: CheckpointTuple | None) -> Any:
    """A tuple as comparable data (the checkpoint's fields, metadata, configs, writes)."""
    if t is None:
        return None
    return (t.config, dict(sorted(t.checkpoint.items())), dict(t.metadata), t.parent_config,
            [tuple(w) for w in t.pending_writes or []])


def fixed(checkpoint: Any, n: int) -> Any:
    """The checkpoint with a fixed, time-ordered id and time (so two savers see the same)."""
    checkpoint["id"] = f"1f000000-0000-6000-8000-{n:012d}"
    checkpoint["ts"] = f"2026-01-01T00:00:{n:02d}+00:00"
    return checkpoint


def drive(saver: BaseCheckpointSaver[Any]) -> list[Any]:
    """One script of checkpointer operations; everything it read, in order."""
    seen: list[Any] = []
    c1 = fixed(empty_checkpoint(), 1)
    c1["channel_values"] = {"messages": ["hi"], "n": 1}
    c1["channel_versions"] = v1 = {"messages": "1", "n": "1"}
    saved1 = saver.put(conf("t1"), c1, {"source": "input", "step": -1, "user": "ann"}, v1)
    c2 = fixed(create_checkpoint(c1, None, 0), 2)
    c2["channel_values"] = {"messages": ["hi", "there"], "n": 2}
    c2["channel_versions"] = v2 = {"messages": "2", "n": "2"}
    saved2 = saver.put(saved1, c2, {"source": "loop", "step": 0, "user": "ann",
                                    "tags": ["a", "b"]}, v2)
    # Writes: two tasks, given out of order; a task re-run keeps its first ordinary write but
    # replaces its special ones (an error, an interrupt).
    saver.put_writes(saved2, [("n", 3), ("messages", "x")], "task-b", "~b")
    saver.put_writes(saved2, [("n", 4)], "task-a", "~a")
    saver.put_writes(saved2, [("n", 99)], "task-a", "~a")
    saver.put_writes(saved2, [(ERROR, "boom"), (INTERRUPT, {"v": 1})], "task-c", "~c")
    saver.put_writes(saved2, [(ERROR, "boom again")], "task-c", "~c")
    # Another namespace of the same thread, and another thread.
    sub = fixed(empty_checkpoint(), 3)
    saver.put(conf("t1", "child:1"), sub, {"source": "input", "step": -1}, {})
    other = fixed(empty_checkpoint(), 4)
    saver.put(conf("t2"), other, {"source": "input", "step": -1, "user": "bob"}, {})

    seen.append(saved1)
    seen.append(saved2)
    seen.append(plain(saver.get_tuple(conf("t1"))))
    seen.append(plain(saver.get_tuple(conf("t1", checkpoint_id=c1["id"]))))
    seen.append(plain(saver.get_tuple(conf("t1", checkpoint_id="no-such-id"))))
    seen.append(plain(saver.get_tuple(conf("nobody"))))
    seen.append(plain(saver.get_tuple(conf("t1", "child:1"))))
    seen.append([plain(t) for t in saver.list(conf("t1"))])
    # Without a namespace: every namespace of the thread (savers differ in their order).
    seen.append(sorted(str(plain(t)) for t in saver.list({"configurable": {"thread_id": "t1"}})))
    seen.append([plain(t) for t in saver.list(conf("t1"), limit=1)])
    before = conf("t1", checkpoint_id=c2["id"])
    seen.append([plain(t) for t in saver.list(conf("t1"), before=before)])
    seen.append([plain(t) for t in saver.list(conf("t1"), filter={"source": "loop"})])
    seen.append([plain(t) for t in saver.list(conf("t1"), filter={"user": "ann"}, limit=1)])
    seen.append([plain(t) for t in saver.list(conf("t1"), filter={"tags": ["a", "b"]})])
    seen.append([plain(t) for t in saver.list(conf("t1"), filter={"user": "nobody"})])
    seen.append(sorted(str(plain(t)) for t in saver.list(None, filter={"step": -1})))
    saver.delete_thread("t1")
    seen.append([plain(t) for t in saver.list(conf("t1"))])
    seen.append(plain(saver.get_tuple(conf("t2"))))
    return seen


async def adrive(saver: BaseCheckpointSaver[Any]) -> list[Any]:
    """The async variants: put, put_writes, get_tuple, list, delete_thread."""
    c1 = fixed(empty_checkpoint(), 5)
    saved = await saver.aput(conf("a1"), c1, {"source": "input", "step": -1}, {})
    await saver.aput_writes(saved, [("n", 1)], "task", "~t")
    seen = [saved, plain(await saver.aget_tuple(conf("a1"))),
            [plain(t) async for t in saver.alist(conf("a1"), limit=5)]]
    await saver.adelete_thread("a1")
    seen.append(plain(await saver.aget_tuple(conf("a1"))))
    return seen


def test_the_checkpointer_answers_as_langgraphs_reference_saver_does(
    redis_url: str, database_url: str
) -> None:
    with DexClient(fast_settings(redis_url, database_url)) as client:
        saver = DexCheckpointer(client)
        reference = InMemorySaver()
        assert drive(saver) == drive(reference)
        assert asyncio.run(adrive(saver)) == asyncio.run(adrive(reference))
        # Versions are LangGraph's increasing string versions.
        v1 = saver.get_next_version(None, None)
        assert saver.get_next_version(v1, None) > v1


class Counted(TypedDict):
    n: int


def build_graph(saver: BaseCheckpointSaver[Any]) -> Any:
    graph = StateGraph(Counted)
    graph.add_node("inc", lambda s: {"n": s["n"] + 1})
    graph.add_node("double", lambda s: {"n": s["n"] * 2})
    graph.add_edge(START, "inc")
    graph.add_edge("inc", "double")
    graph.add_edge("double", END)
    return graph.compile(checkpointer=saver, interrupt_before=["double"])


CHILD = """
import sys
from dex_tasks import DexClient
from dex_tasks.integrations.langchain import DexCheckpointer
from tests.test_checkpointer import build_graph

with DexClient.from_env() as client:
    graph = build_graph(DexCheckpointer(client))
    config = {"configurable": {"thread_id": "th-graph"}}
    print(graph.invoke(None, config, durability="sync")["n"])
"""


def test_a_graph_paused_in_one_process_is_resumed_from_the_store_by_another(
    redis_url: str, database_url: str
) -> None:
    settings = fast_settings(redis_url, database_url)
    with DexClient(settings) as client:
        graph = build_graph(DexCheckpointer(client))
        config = {"configurable": {"thread_id": "th-graph"}}
        # The graph runs "inc" and stops before "double" (an interrupt), checkpointed.
        assert graph.invoke({"n": 1}, config, durability="sync") == {"n": 2}
        assert graph.get_state(config).next == ("double",)
        history = list(graph.get_state_history(config))
    # Another process, with a client of its own on the same store, goes on from there.
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                          text=True, env=settings_env(settings), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "4"
    with DexClient(settings) as client:
        graph = build_graph(DexCheckpointer(client))
        assert graph.get_state(config).values == {"n": 4}
        assert len(list(graph.get_state_history(config))) == len(history) + 1


def test_bad_use_names_what_is_wrong() -> None:
    with pytest.raises(Exception, match="client must be a DexClient"):
        DexCheckpointer("sqlite:///x.db")  # type: ignore[arg-type]
