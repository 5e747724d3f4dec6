"""``DexCheckpointer`` loads no code a stored checkpoint names (issue 28, item 4).

LangGraph's default serializer rebuilds an object by importing the module and calling the name
that the stored bytes give, so write access to ``dex_checkpoints`` was code execution in every
agent that resumed the thread. Here a checkpoint, or a pending write, is written straight into
the store (as someone with access to the tables would) naming ``os.system`` with a command that
creates a file; resuming the thread must refuse it, and the file must never appear. Then what
the app declares still round-trips, and what it does not is refused when it is stored, not
when a later process cannot load it. SQLite and PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from enum import Enum
from pathlib import Path
from typing import Any

import ormsgpack
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import (
    EXT_CONSTRUCTOR_KW_ARGS,
    EXT_CONSTRUCTOR_POS_ARGS,
    EXT_CONSTRUCTOR_SINGLE_ARG,
    EXT_METHOD_SINGLE_ARG,
    EXT_PYDANTIC_V1,
    EXT_PYDANTIC_V2,
)
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from dex_tasks import DexClient
from dex_tasks.integrations.langchain import DexCheckpointer, UnsafeCheckpointError
from tests.conftest import fast_settings

CHECKPOINT_ID = "1f000000-0000-6000-8000-000000000001"
CONFIG = {"configurable": {"thread_id": "victim", "checkpoint_ns": ""}}


def os_system(code: int, command: str) -> ormsgpack.Ext:
    """An object in LangGraph's msgpack form that names ``os.system`` with ``command``: each
    of LangGraph's constructor forms calls it in its own way."""
    payload: tuple[Any, ...] = {
        EXT_CONSTRUCTOR_SINGLE_ARG: ("os", "system", command),
        EXT_CONSTRUCTOR_POS_ARGS: ("os", "system", (command,)),
        EXT_CONSTRUCTOR_KW_ARGS: ("os", "system", {"command": command}),
        EXT_PYDANTIC_V1: ("os", "system", {"command": command}),
        EXT_PYDANTIC_V2: ("os", "system", {"command": command}, "model_validate_json"),
        EXT_METHOD_SINGLE_ARG: ("os", "system", command, "__call__"),
    }[code]
    return ormsgpack.Ext(code, ormsgpack.packb(payload))


def tampered_checkpoint(bomb: Any) -> bytes:
    checkpoint: dict[str, Any] = {**empty_checkpoint(), "id": CHECKPOINT_ID}
    checkpoint["channel_values"] = {"messages": ["hello", {"nested": [bomb]}]}
    return ormsgpack.packb(checkpoint, option=ormsgpack.OPT_NON_STR_KEYS)


def plant(client: DexClient, *, checkpoint: bytes, write: tuple[str, bytes] | None = None,
          type_: str = "msgpack") -> None:
    """Write rows into the checkpoint tables directly, as an attacker with table access."""
    store = client.checkpoints
    store.put("victim", "", CHECKPOINT_ID, None, type_, checkpoint,
              {"source": "loop", "step": 1})
    if write is not None:
        store.put_writes("victim", "", CHECKPOINT_ID, "task-1", "", [(0, "messages", *write)])


@pytest.fixture
def dex(redis_url: str, database_url: str) -> Any:
    with DexClient(fast_settings(redis_url, database_url)) as client:
        yield client


CODES = [EXT_CONSTRUCTOR_SINGLE_ARG, EXT_CONSTRUCTOR_POS_ARGS, EXT_CONSTRUCTOR_KW_ARGS,
         EXT_PYDANTIC_V1, EXT_PYDANTIC_V2, EXT_METHOD_SINGLE_ARG]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("where", ["checkpoint", "pending write"])
def test_a_stored_blob_naming_os_system_is_refused_and_never_called(
    dex: DexClient, tmp_path: Path, code: int, where: str
) -> None:
    # Given a checkpoint (or a write against it) naming os.system with a command
    marker = tmp_path / "pwned"
    bomb = os_system(code, f"touch {marker}")
    if where == "checkpoint":
        plant(dex, checkpoint=tampered_checkpoint(bomb))
    else:
        plant(dex, checkpoint=tampered_checkpoint("harmless"),
              write=("msgpack", ormsgpack.packb([bomb])))
    saver = DexCheckpointer(dex)
    # When an agent resumes the thread (reads its checkpoint, lists its history)
    with pytest.raises(UnsafeCheckpointError, match=r"os\.system"):
        saver.get_tuple(CONFIG)
    with pytest.raises(UnsafeCheckpointError, match=r"os\.system"):
        list(saver.list(CONFIG))
    # Then the command never ran
    assert not marker.exists()


class Bomb:
    """Pickles as a call of os.system (never unpickled here)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_forms_that_can_name_code_are_refused(dex: DexClient, tmp_path: Path,
                                              form: str) -> None:
    marker = tmp_path / "pwned"
    if form == "pickle":
        blob = pickle.dumps(Bomb(f"touch {marker}"))
    else:
        blob = json.dumps({"lc": 2, "type": "constructor", "id": ["os", "system"],
                           "args": [f"touch {marker}"]}).encode()
    plant(dex, checkpoint=blob, type_=form)
    with pytest.raises(UnsafeCheckpointError, match=form):
        DexCheckpointer(dex).get_tuple(CONFIG)
    assert not marker.exists()


class Mood(Enum):
    CALM = "calm"


@dataclasses.dataclass
class Ticket:
    order_id: str
    mood: Mood


class TicketState(TypedDict):
    ticket: Ticket


def ticket_graph(saver: DexCheckpointer) -> Any:
    graph = StateGraph(TicketState)
    graph.add_node("touch", lambda s: {"ticket": dataclasses.replace(s["ticket"],
                                                                     order_id="1002")})
    graph.add_edge(START, "touch")
    graph.add_edge("touch", END)
    return graph.compile(checkpointer=saver)


def test_declared_state_types_round_trip_and_undeclared_ones_are_refused_when_stored(
    dex: DexClient,
) -> None:
    config = {"configurable": {"thread_id": "tickets"}}
    ticket = Ticket("1001", Mood.CALM)
    # Undeclared: refused as the graph stores it, naming the type and how to declare it
    with pytest.raises(UnsafeCheckpointError, match=r"serde\.(Ticket|Mood), .*allowed_types"):
        ticket_graph(DexCheckpointer(dex)).invoke({"ticket": ticket}, config)
    # Declared (a class, or a (module, name) pair): stored and loaded back as itself
    saver = DexCheckpointer(dex, allowed_types=[Ticket, (Mood.__module__, "Mood")])
    graph = ticket_graph(saver)
    assert graph.invoke({"ticket": ticket}, {"configurable": {"thread_id": "t2"}}) == {
        "ticket": Ticket("1002", Mood.CALM)}
    loaded = saver.get_tuple({"configurable": {"thread_id": "t2"}})
    assert loaded is not None
    assert loaded.checkpoint["channel_values"]["ticket"] == Ticket("1002", Mood.CALM)
    # LangGraph's own types need no declaration
    messages = [HumanMessage("hi", id="h"), AIMessage("hello", id="a")]
    assert saver.serde.loads_typed(saver.serde.dumps_typed(messages)) == messages


def test_langgraphs_derived_allow_list_is_honoured(dex: DexClient) -> None:
    # LangGraph calls with_allowlist with the state schema's types when
    # LANGGRAPH_STRICT_MSGPACK is on
    saver = DexCheckpointer(dex)
    widened = saver.with_allowlist({(Ticket.__module__, "Ticket"), (Mood.__module__, "Mood")})
    assert widened is not saver and widened.with_allowlist({(Mood.__module__, "Mood")}) is widened
    value = Ticket("1001", Mood.CALM)
    assert widened.serde.loads_typed(widened.serde.dumps_typed(value)) == value
    with pytest.raises(UnsafeCheckpointError):
        saver.serde.dumps_typed(value)


def test_bad_declarations_name_what_is_wrong(dex: DexClient) -> None:
    with pytest.raises(ValueError, match="allowed_types must hold classes"):
        DexCheckpointer(dex, allowed_types=["os.system"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="allowed_types must be a list"):
        DexCheckpointer(dex, allowed_types="os")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        DexCheckpointer(dex, allowed_types=[Ticket], serde=DexCheckpointer(dex).serde)
