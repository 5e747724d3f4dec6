"""LangChain / LangGraph: every tool call of a ``create_agent`` agent runs through dex-tasks.

    from dex_tasks import DexClient
    from dex_tasks.integrations.langchain import DexMiddleware, dex_tools

    client = DexClient.from_env()
    agent = create_agent(model, tools=dex_tools(client), middleware=[DexMiddleware(client)],
                         checkpointer=checkpointer)

:class:`DexMiddleware` sends each tool call the model makes to ``client.call_tool`` and waits
for its record; the tool itself runs on a dex-tasks worker. :func:`dex_tools` builds LangChain
tools from the catalog the workers published (the JSON schema of each tool's arguments, its
docstring as the description), so the agent process need not import any tool code. An agent
that keeps its own LangChain tools adds only the middleware: the workers must serve tools of the
same names.

Idempotency keys come from ids LangGraph keeps in the checkpoint: the session is the thread id,
the turn is the id of the AI message that holds the call, and the call is the model's tool-call
id. LangGraph re-runs a node from its start when a run resumes, is replayed from a checkpoint,
or is re-invoked after a crash; the same ids give the same key, so the tool does not start
again: the node reads the call's record instead. (A fake model that reuses tool-call ids across
turns does not collide either, since each turn is its own AI message.)

A call that needs approval pauses the graph with LangGraph's ``interrupt()``, whose value is
the dex interrupt: ``{"type": "dex_approval", "interrupt_id", "session_id", "key", "tool",
"arguments", "effect", "tool_call_id"}``. The agent process may exit. Once someone has called
``resolve_interrupt`` (Python, the CLI, the HTTP API or the approval page), any process with the
same checkpointer resumes the graph::

    agent.invoke(resume_command(agent.get_state(config)), config)

The resume value only wakes the graph up: the decision recorded in dex-tasks is the one that
counts, so a forged or stale resume value approves nothing (the graph pauses again while the
call is undecided). A rejection reaches the model as the tool's result, carrying the person's
message.

A new input while the thread's turn is open (a call awaits a person) is held until the turn
ends, as DESIGN says: queued in the dex session, kept out of what the model reads, the open
turn going on (see ``dex_tasks.integrations.langchain.queue``).

A tool node that has waited ``wait_timeout`` seconds raises ``TimeoutError``; invoking the
graph again (``agent.invoke(None, config)``) re-runs the node, which waits for the same call.
Pass ``durability="sync"`` to ``invoke`` where a crash must never re-run the model: with
LangGraph's default (``"async"``) the checkpoint holding the model's answer is written while
the tools already run, so a process killed in those milliseconds re-asks the model, and its
new answer's calls are new calls (``"exit"`` widens that window to the whole run).
"""


from __future__ import annotations

from dex_tasks.integrations.extras import needs_extra

with needs_extra("langchain", "dex_tasks.integrations.langchain"):
    import langchain.agents.middleware  # noqa: F401 - tells a missing extra from other errors
    import langgraph.checkpoint.base  # noqa: F401

from dex_tasks import key_part
from dex_tasks.integrations.langchain.approvals import apply_decisions, resume_command
from dex_tasks.integrations.langchain.calls import DEFAULT_WAIT_TIMEOUT, DEX_APPROVAL
from dex_tasks.integrations.langchain.calls import tool_message as _tool_message  # noqa: F401 - its name before the split
from dex_tasks.integrations.langchain.checkpointer import DexCheckpointer
from dex_tasks.integrations.langchain.middleware import DexMiddleware
from dex_tasks.integrations.langchain.serde import StrictSerializer, UnsafeCheckpointError
from dex_tasks.integrations.langchain.tools import dex_tools

__all__ = [
    "DEFAULT_WAIT_TIMEOUT",
    "DEX_APPROVAL",
    "DexCheckpointer",
    "DexMiddleware",
    "StrictSerializer",
    "UnsafeCheckpointError",
    "apply_decisions",
    "dex_tools",
    "key_part",
    "resume_command",
]
