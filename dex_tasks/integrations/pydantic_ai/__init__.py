"""Pydantic AI: every tool call of an agent runs through dex-tasks; approvals are deferred tools.

The lines a user adds (``pip install "dex-tasks[pydantic-ai]"``)::

    from dex_tasks import DexClient
    from dex_tasks.integrations.pydantic_ai import DexCapability
    dex = DexCapability(DexClient.from_env())
    agent = Agent(model, capabilities=[dex], output_type=[str, DeferredToolRequests])
    results = await dex.deferred_results(history)  # on resume: deferred_tool_results=results

With ``session_id=`` each run is a durable turn (the five lines of ``docs/durable-turns.md``)::

    from dex_tasks import DexClient
    from dex_tasks.integrations.pydantic_ai import DexCapability
    client = DexClient.from_env()
    dex = DexCapability(client, session_id="ticket-42")
    result = await agent.run("Refund order 1001", capabilities=[dex])

**Durable turns** (``session_id=`` given). The run begins the session's turn with its input
(``client.begin_turn``), or continues the one a killed process left open: running the same
code again with the same session and input is the restart, with no history saved by hand.
Every model request of the turn is a step (its position: the responses since the turn's user
prompt): a journaled step's response is replayed from the store instead of asking the model
(``wrap_model_request`` returns it without calling the model, as Pydantic AI's Temporal and DBOS
integrations replay a recorded activity); a new response that calls tools is journaled with its
calls of catalog tools (``client.record_step``: one transaction) before any call is sent. A
response without tool calls is the answer: the run's output ends the turn (``end_turn``), and
the session's user messages that waited for it are delivered; a run that ends on deferred calls
leaves it open. Keys are ``session/turn/<step>.<the model's call id>``, all taken from the
journaled response, so a replay gives the same keys even though a real model mints new ids each
time it is asked (and fake models that reuse ids get distinct keys). A run with another input
while the session's turn is open raises :class:`TurnInProgressError` (the input is queued, the
model not asked); run it again once that turn ended, and its turn begins from the queued
message.

**Which tools.** The capability wraps the agent's toolset (``get_wrapper_toolset``) and adds the
tools the workers published to the dex-tasks catalog (``client.list_tools()``: name, docstring,
JSON schema), so the agent process need not import any tool code; ``names=`` picks some of them.
A tool the agent defines itself (``@agent.tool``, a toolset) under the name of a catalog tool is
routed to dex-tasks too: the model sees the agent's definition, a worker runs the catalog's
code, and the local function body never runs. Any other tool that would run code in the agent
process (the agent's own, or one another capability contributes) would bypass dex-tasks, so the
run stops at its first step with a :class:`~dex_tasks.ConfigurationError` naming it, unless it
is listed in ``local_tools=`` (it then runs in the agent process, as before). Pydantic AI's own
typed tools (tool search, capability loading), output tools and external tools are left alone.

**The idempotency key** without ``session_id`` (``session/turn/call``) is built only from what
the message history keeps, so a run resumed in another process from the saved history finds the
same calls:

* session: the Pydantic AI conversation id of the response that
  holds the call (``agent.run(..., conversation_id="ticket-42")`` chooses it; Pydantic AI stores
  it on every message and a resumed run inherits it). Not ``run_id`` (what pydantic-ai PR
  #7531 proposed keying on): a resumed run gets a new one.
* turn: the model response's ``provider_response_id``; when the model gives none (the offline
  ``TestModel`` and ``FunctionModel`` do not), a hash of the response's timestamp and tool calls,
  which the saved history keeps exactly. Not the response's position in the history: trimming or
  summarising old messages would move it and give an old call a new key.
* call: the model's tool-call id. Fake models that reuse ids across turns get distinct keys,
  because the turn differs.

An id dex-tasks would refuse (``/``, over 200 characters) is shortened deterministically: a
readable prefix and a hash of the whole id.

**Approvals.** A call whose policy needs approval is recorded ``awaiting_approval`` and the tool
raises Pydantic AI's ``ApprovalRequired``: the run ends with ``DeferredToolRequests`` (so the
agent's ``output_type`` must include it), whose ``metadata[tool_call_id]`` carries ``dex_key``,
``dex_session_id`` and ``dex_interrupt_id``. Save ``result.all_messages()`` and exit; a person
decides with ``resolve_interrupt``; a new process loads the history and resumes with
``deferred_tool_results=await dex.deferred_results(history)`` (or
:func:`dex_deferred_results`). An approved call is answered ``ToolApproved`` and runs through
dex-tasks under its key, so it runs once however often the resume is replayed; a rejected one is
answered ``ToolDenied`` with the call's error (``APPROVAL_REJECTED ...`` and the person's
message), which the model reads as the tool's result. A ``ToolApproved`` is never taken on
trust (pydantic-ai issue #5536): the call goes back to dex-tasks, whose record decides (a call
dex-tasks still holds is deferred again; one it rejected returns its rejection). A tool the
agent itself marks ``requires_approval=True`` is deferred by Pydantic AI before dex-tasks sees
the call: answer that approval as before (``dex_deferred_results`` leaves calls dex-tasks does
not know out); dex-tasks' policy then applies as well.

**Edits.** A person may approve with edited arguments in dex-tasks (``resolve_interrupt(...,
arguments=...)``, the page's edit box) or in your own approval UI the Pydantic AI way,
``ToolApproved(override_args={...})``: hand those decisions to dex-tasks with
``await dex.apply_decisions(requests, decisions, approver="alice")`` (or
:func:`dex_apply_decisions`), which records each as ``resolve_interrupt`` would (an edit is
checked against the tool's schema) and returns what to resume with. An edited call is answered
``ToolApproved(override_args=<the edited arguments>)``; the tool runs once with them under the
call's key, and the model reads its result with a note beside it (``ToolReturn.content``) that
says which arguments were changed.

**Results.** A call that succeeded returns its result to the model. A call that failed, was
rejected or ended ``outcome_unknown`` raises Pydantic AI's ``ToolFailed`` with the call's
error, which the model reads as a failed tool result (the error says whether the tool ran). A
call still unfinished after ``timeout`` seconds is deferred (``CallDeferred``, with the same
metadata) rather than abandoned: it keeps running on its worker, and resuming waits for it
under the same key.
"""

from __future__ import annotations

from dex_tasks.integrations.extras import needs_extra

with needs_extra("pydantic-ai", "dex_tasks.integrations.pydantic_ai"):
    import pydantic_ai.capabilities  # noqa: F401 - tells a missing extra from other errors

from dex_tasks.integrations.pydantic_ai.approvals import dex_apply_decisions, dex_deferred_results
from dex_tasks.integrations.pydantic_ai.capability import DexCapability
from dex_tasks.integrations.pydantic_ai.errors import ApprovalPendingError, TurnInProgressError

__all__ = ["ApprovalPendingError", "DexCapability", "TurnInProgressError", "dex_apply_decisions",
           "dex_deferred_results"]
