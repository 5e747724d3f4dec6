"""OpenAI Agents SDK adapter: the agent's tools run as dex-tasks calls, approvals pause the run.

The five lines a user writes (``client`` is a ``DexClient`` or an ``AsyncDexClient``)::

    from dex_tasks.integrations.openai_agents import apply_dex_decisions, dex_function_tools
    agent = Agent(name="support", instructions="...", tools=dex_function_tools(client))
    result = await Runner.run(agent, text, context={"session_id": "s-42", "turn_id": "t-7"})
    while result.interruptions and not await apply_dex_decisions(st := result.to_state(), client):
        result = await Runner.run(agent, st)

If ``result.interruptions`` is still non-empty after the loop, a person has yet to decide: save
``st.to_string()`` and exit. Any process resumes it later: ``st = await
RunState.from_string(agent, saved)``, then the same loop from ``apply_dex_decisions`` on, with
``Runner.run(agent, st)`` (give no ``context=`` there: the state carries it).
``dex_context(session_id)`` builds the context with a fresh ``turn_id``.

How it works:

* :func:`dex_function_tools` builds one ``FunctionTool`` per tool of the published catalog
  (``client.list_tools()``): its name, description (the docstring) and parameters schema.
  ``strict_json_schema`` is on only when the catalog schema already is a strict schema (every
  property required, no extra properties): making it strict would otherwise change what the
  tool accepts. ``needs_approval`` is the tool's dex policy: a flag, or for a rule on the
  arguments (``requires_approval=when(...)``) a callable that asks the rule, so that only the
  calls it sends to a person pause the run. Invoking the tool records the call
  with ``call_tool`` and waits for its result, which the model reads as JSON text; a call that
  failed, was rejected or whose outcome is unknown gives the model its error text instead.
* The idempotency key is ``session_id/turn_id/call id``: the session and the turn from the run
  context (:func:`dex_context`, or any mapping or object with ``session_id`` and ``turn_id``),
  and the model's tool-call id. ``RunState`` keeps all three across ``to_string``/``from_string``
  (a mapping context needs no deserializer), so a resumed, replayed or re-run step finds its
  call instead of starting a new one. Use one ``turn_id`` per ``Runner.run`` on new input: fake
  models reuse call ids from one run to the next, and within a run the SDK itself refuses to
  treat one call id as two invocations. The call id goes into the key through
  ``dex_tasks.key_part``, one-to-one: two different call ids never give one key.
* Approval uses the SDK's human-in-the-loop: a call whose policy needs approval pauses the run
  (``result.interruptions``). :func:`apply_dex_decisions` records each pending call in dex-tasks,
  which holds it ``awaiting_approval`` with an interrupt a person decides
  (``resolve_interrupt``, the approval page, ``dex-tasks approvals``); once decided it approves
  or rejects the SDK's item: approved calls run on a worker (once, whoever resumes, however
  often), a rejection reaches the model as the tool's result with the person's message.
* Another input while the session's durable turn is open (under :func:`dex_run_config`):
  ``Runner.run`` raises :class:`TurnInProgressError` and the input waits, queued in the
  session; the model is not asked. Run it again once the turn ended: its turn begins from the
  queued message.
* Edits: the SDK has no edit decision of its own (``RunState.approve`` takes no arguments).
  A person edits in dex-tasks, ``resolve_interrupt(..., arguments=...)`` (the page's edit box,
  ``dex-tasks approvals approve --arguments``); :func:`apply_dex_decisions` then approves the
  SDK's item and the invocation runs the dex call under its key, with the edited arguments.
  The model reads the result after the note that says what was changed.
* The SDK asks ``needs_approval`` before it runs a tool's input guardrails, so a call the
  guardrails refuse would still be put to a person. :func:`apply_dex_decisions` therefore runs
  the tool's input guardrails itself before it records a call: a refusal records nothing, and
  ends the call the way the SDK's ``pre_approval_tool_input_guardrails`` mode does (the
  guardrail's message is the tool result; ``raise_exception`` raises
  ``ToolInputGuardrailTripwireTriggered``). The SDK runs the guardrails again before an approved
  call is invoked.
"""

from __future__ import annotations

from dex_tasks.integrations.extras import needs_extra

with needs_extra("openai-agents", "dex_tasks.integrations.openai_agents"):
    import agents  # noqa: F401 - only to tell a missing extra from other import errors

from dex_tasks.integrations.openai_agents.approvals import apply_dex_decisions
from dex_tasks.integrations.openai_agents.context import dex_context
from dex_tasks.integrations.openai_agents.journal import TurnInProgressError, dex_run_config
from dex_tasks.integrations.openai_agents.tools import (
    DEFAULT_TIMEOUT,
    ApprovalPendingError,
    CallStillRunningError,
    dex_function_tools,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "ApprovalPendingError",
    "CallStillRunningError",
    "TurnInProgressError",
    "apply_dex_decisions",
    "dex_context",
    "dex_function_tools",
    "dex_run_config",
]
