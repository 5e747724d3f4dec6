"""``DexCheckpointer`` against LangGraph's own conformance suite (``langgraph-checkpoint-
conformance``), every capability it defines, on SQLite and PostgreSQL (issue 28, item 8).

The base capabilities (put, put_writes, get_tuple, list, delete_thread) passed before; the
extended ones (``prune``, ``copy_thread``, ``delete_for_runs``) were not implemented, so the
suite skipped them. Then what the suite does not cover: ``keep_latest`` on a graph whose state
is a ``DeltaChannel`` (the value is rebuilt from ancestors' writes, which a naive prune
drops), and a copied thread that goes on on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Annotated, Any

import pytest
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from dex_tasks import DexClient
from dex_tasks.integrations.langchain import DexCheckpointer
from tests.conftest import fast_settings


def test_every_capability_of_langgraphs_conformance_suite_passes(
    redis_url: str, database_url: str
) -> None:
    with DexClient(fast_settings(redis_url, database_url)) as client:
        @checkpointer_test(name="DexCheckpointer")
        async def fresh() -> AsyncIterator[DexCheckpointer]:
            yield DexCheckpointer(client)

        report = asyncio.run(validate(fresh))
    results = report.results
    # Every capability was detected and run: none skipped as not implemented
    assert {name for name, r in results.items() if r.detected} == {
        c.value for c in ALL_CAPABILITIES}
    assert {name: r.failures for name, r in results.items() if not r.passed} == {}
    passed = {name: r.tests_passed for name, r in results.items()}
    # (58 base tests, measured before; then 7 delete_for_runs, 8 copy_thread, 8 prune)
    assert sum(passed[c] for c in ("put", "put_writes", "get_tuple", "list",
                                   "delete_thread")) == 58, passed
    assert (passed["delete_for_runs"], passed["copy_thread"], passed["prune"]) == (7, 8, 8)


def add(state: Sequence[str], writes: Sequence[Sequence[str]]) -> list[str]:
    return [*state, *(item for batch in writes for item in batch)]


class Log(TypedDict):
    log: Annotated[list[str], DeltaChannel(add, snapshot_frequency=5)]


def log_graph(saver: DexCheckpointer) -> Any:
    graph = StateGraph(Log)
    graph.add_node("a", lambda s: {"log": [f"a{len(s['log'])}"]})
    graph.add_node("b", lambda s: {"log": [f"b{len(s['log'])}"]})
    graph.add_edge(START, "a")
    graph.add_edge("a", "b")
    graph.add_edge("b", END)
    return graph.compile(checkpointer=saver)


@pytest.fixture
def saver(redis_url: str, database_url: str) -> Iterator[DexCheckpointer]:
    with DexClient(fast_settings(redis_url, database_url)) as client:
        yield DexCheckpointer(client)


def test_keep_latest_keeps_what_a_delta_channel_is_rebuilt_from(saver: DexCheckpointer) -> None:
    graph = log_graph(saver)
    config = {"configurable": {"thread_id": "delta"}}
    # Given a thread of several runs whose state lives in a DeltaChannel (snapshotted every
    # fifth update: the newest checkpoint holds no value of its own, its ancestors' writes
    # since the last snapshot make it)
    for n in range(4):
        graph.invoke({"log": [f"in{n}"]}, config)
    newest = saver.get_tuple(config)
    assert newest is not None and "log" not in newest.checkpoint["channel_values"]
    before = graph.get_state(config).values
    assert len(before["log"]) == 12
    history = len(list(saver.list(config)))
    # When it is pruned to its latest checkpoint
    saver.prune(["delta"], strategy="keep_latest")
    # Then fewer checkpoints remain, and the state is what it was
    kept = len(list(saver.list(config)))
    assert 1 < kept < history
    assert graph.get_state(config).values == before
    # And the thread goes on from it
    after = graph.invoke({"log": ["in4"]}, config)
    assert after["log"][:12] == before["log"] and len(after["log"]) == 15

    # A copy goes on on its own; the source is left as it was
    saver.copy_thread("delta", "fork")
    fork = {"configurable": {"thread_id": "fork"}}
    assert graph.get_state(fork).values == graph.get_state(config).values
    graph.invoke({"log": ["fork"]}, fork)
    assert len(graph.get_state(fork).values["log"]) == 18
    assert len(graph.get_state(config).values["log"]) == 15

    # "delete" leaves nothing
    saver.prune(["delta", "fork"], strategy="delete")
    assert list(saver.list(config)) == [] and list(saver.list(fork)) == []
    # A strategy LangGraph does not define is refused, naming the ones it does
    try:
        saver.prune(["x"], strategy="keep_some")
    except ValueError as err:
        assert "keep_latest, delete" in str(err)
    else:
        raise AssertionError("an unknown strategy was accepted")


RUN_1, RUN_2 = "11111111-1111-4111-8111-111111111111", "22222222-2222-4222-8222-222222222222"


def test_delete_for_runs_takes_only_those_runs_checkpoints(saver: DexCheckpointer) -> None:
    graph = log_graph(saver)
    config = {"configurable": {"thread_id": "runs"}}
    # (LangGraph records a run's id in each checkpoint's metadata, from the run's config)
    for text, run in (("one", RUN_1), ("two", RUN_2)):
        graph.invoke({"log": [text]}, {**config, "metadata": {"run_id": run}})
    runs = [t.metadata.get("run_id") for t in saver.list(config)]
    assert set(runs) == {RUN_1, RUN_2}
    saver.delete_for_runs([RUN_1])
    assert {t.metadata.get("run_id") for t in saver.list(config)} == {RUN_2}
