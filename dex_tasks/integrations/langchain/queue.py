"""A new input while the thread's turn is open: held until that turn ends (``DexMiddleware``).

LangGraph's own answer to ``agent.invoke({"messages": [new]}, config)`` on a thread paused on an
approval is to drop the pause (its pending tool step is discarded) and ask the model with the
new message after an AI message whose tool calls nobody answered: the model answers the new
message as if the open calls had not been made, and the call a person approves later runs with
nobody to read its result. dex-tasks' rule (DESIGN, "Durable turns") is the seeds' one: a
message sent while a turn is open is queued, and delivered when the turn ends.

So, at the start of a run (``before_agent``), human messages that follow an AI message with
unanswered tool calls are taken out of the messages the model reads, kept in the graph's state
(``dex_queued``, checkpointed with it) and stored in the dex session as user messages (its
snapshot shows them ``queued`` while a dex call of the turn is open: the store delivers them
when the calls end); the run goes back to the tool step, which finds each call
by its key (a call still held for a person pauses the graph again, as before the new input; a
call that ended gives its result). When the model answers without tools (``after_model``: the
turn has ended), the held messages are added after its answer and the model is asked again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NotRequired

from langchain.agents.middleware import AgentState
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, RemoveMessage, ToolMessage
from langgraph.config import get_config

from dex_tasks import DexClient, key_part


class QueueState(AgentState[Any]):
    """The agent state with the messages held while a turn is open."""

    dex_queued: NotRequired[list[AnyMessage]]


def open_calls(messages: Sequence[Any]) -> int | None:
    """The index of the AI message whose tool calls are not all answered yet (the open
    turn's latest step), or None when the last AI message's calls are all answered."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, AIMessage):
            if not message.tool_calls:
                return None
            answered = {m.tool_call_id for m in messages[index + 1:]
                        if isinstance(m, ToolMessage)}
            pending = [c for c in message.tool_calls if c.get("id") not in answered]
            return index if pending else None
    return None


def hold_new_input(client: DexClient, state: Any) -> dict[str, Any] | None:
    """The state update that holds the human messages given after the open turn's step
    (``before_agent``), or None when no turn is open or nothing new was given."""
    messages = state.get("messages") or []
    at = open_calls(messages)
    if at is None:
        return None
    new = [m for m in messages[at + 1:] if isinstance(m, HumanMessage)]
    if not new:
        return None
    session = _session()
    if session is not None:
        _record_queued(client, session, [_text(m) for m in new])
    return {"messages": [RemoveMessage(id=m.id) for m in new if m.id],
            "dex_queued": [*(state.get("dex_queued") or []), *new],
            "jump_to": "tools"}


def deliver_held(state: Any) -> dict[str, Any] | None:
    """Once the model answered without tools (``after_model``), the held messages after
    its answer, and the model asked again; None when nothing is held or the turn goes on."""
    held = state.get("dex_queued") or []
    messages = state.get("messages") or []
    if not held or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, AIMessage) or last.tool_calls:
        return None
    return {"messages": list(held), "dex_queued": [], "jump_to": "model"}


def _session() -> str | None:
    thread_id = (get_config().get("configurable") or {}).get("thread_id")
    return None if thread_id in (None, "") else key_part(str(thread_id))


def _text(message: HumanMessage) -> str:
    content = message.content
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True,
                                                              default=str)


def _record_queued(client: DexClient, session: str, texts: list[str]) -> None:
    """Store each held message in the dex session once (a run re-run after a crash finds
    them there already)."""
    stored = [m.text for m in client.get_agent_snapshot(session).messages
              if m.status == "queued"]
    for text in texts:
        if text in stored:
            stored.remove(text)
        else:
            client.send_user_message(session, text)
