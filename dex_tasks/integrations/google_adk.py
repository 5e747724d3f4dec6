"""Google ADK adapter: an ADK agent's tools run as dex-tasks calls; approvals are ADK's own
tool confirmations, decided in dex-tasks.

The five lines a user writes (``client`` is a ``DexClient`` or an ``AsyncDexClient``)::

    from dex_tasks.integrations.google_adk import dex_adk_tools, dex_confirmations
    agent = LlmAgent(name="support", model=model, tools=dex_adk_tools(client))
    runner = Runner(agent=agent, app_name="shop", session_service=SqliteSessionService(path))
    events = runner.run_async(user_id=user, session_id=sid, new_message=message)
    # later, in any process, once a person decided: new_message=await dex_confirmations(...)

How it works:

* :func:`dex_adk_tools` builds one ADK ``BaseTool`` per tool of the published catalog
  (``client.list_tools()``): its name, description and parameters JSON schema. Running it
  records the call with ``call_tool`` and waits for its result, which the model reads; a call
  that failed, was rejected or whose outcome is unknown gives the model ``{"error": text}``
  with the dex text.
* The idempotency key is ``session / invocation / function call``: the ADK session id, the id
  of the invocation whose model response requested the call (read from the session's events,
  so a call re-run in a later invocation, as a confirmed call is, keeps its key), and the
  function-call id. Each id is percent-encoded where it holds ``/``, ``%`` or a character a
  key refuses, so two different ids never share a key.
* ADK's resumption of an invocation (a resumable ``App``, ``run_async(invocation_id=...)``)
  is at least once: it runs a recorded function call again after the process died. That run
  has the same key, so it waits for the call already made instead of starting the tool again.
* A call that needs approval asks for ADK's tool confirmation
  (``tool_context.request_confirmation``): the run ends with an ``adk_request_confirmation``
  function call, as for any ADK tool with ``require_confirmation``, while dex-tasks holds the
  call ``awaiting_approval`` for a person (``resolve_interrupt``, the approval page,
  ``dex-tasks approvals``). With a persistent session service (``SqliteSessionService``,
  ``DatabaseSessionService``) the process may exit. Once decided,
  :func:`dex_confirmations` builds the message that answers ADK's confirmation requests from
  the dex decisions; running it resumes the agent, in any process: an approved call runs
  once, a rejection reaches the model as the tool's error with the person's message. The dex
  decision counts, not the confirmation's ``confirmed`` flag: a confirmation sent before a
  person decided (forged, or early) approves nothing; the model reads that the call awaits
  approval. (ADK 2.13 asks no second confirmation for a tool it re-ran, so such a run cannot
  be resumed through ADK again: the call stays held in dex-tasks, and a new request of the
  model is a new call.)
* :class:`DexAdkPlugin` (``App(..., plugins=[DexAdkPlugin(client)])``) holds a new message
  sent while a call of the session is open: queued in dex-tasks, kept from the model, the run
  ended before the model is asked; sent again once the turn ended, it is answered.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

from dex_tasks.integrations.extras import needs_extra

with needs_extra("google-adk", "dex_tasks.integrations.google_adk"):
    from google.adk.agents.invocation_context import InvocationContext
    from google.adk.plugins.base_plugin import BasePlugin
    from google.adk.sessions import Session
    from google.adk.tools.base_tool import BaseTool
    from google.adk.tools.tool_context import ToolContext
    from google.genai import types

from dex_tasks import (
    AsyncDexClient,
    CallNotFoundError,
    CallStatus,
    DexClient,
    EffectClass,
    ToolCallRecord,
    ToolSpec,
    UnknownToolError,
    idempotency_key,
)

__all__ = ["DEFAULT_TIMEOUT", "DexAdkPlugin", "DexAdkTool", "dex_adk_tools", "dex_confirmations",
           "dex_key"]

DEFAULT_TIMEOUT = 120.0
"""Seconds a tool call waits for its dex call to end before it tells the model it still runs."""

# ADK's name for the function call that asks a person to confirm a tool call.
CONFIRMATION_CALL = "adk_request_confirmation"
# Characters an id keeps as they are in a key; every other one is percent-encoded.
_KEPT = re.compile(r"[A-Za-z0-9._:~-]")


class DexAdkTool(BaseTool):
    """One published dex tool as an ADK tool (built by :func:`dex_adk_tools`)."""

    def __init__(self, client: AsyncDexClient, spec: ToolSpec,
                 default_effect: EffectClass | str | None, timeout: float) -> None:
        super().__init__(name=spec.name, description=spec.description or spec.name)
        self.client = client
        self.spec = spec
        self.default_effect = default_effect
        self.timeout = timeout

    def _get_declaration(self) -> types.FunctionDeclaration:
        return types.FunctionDeclaration(
            name=self.name, description=self.description,
            parameters_json_schema=copy.deepcopy(self.spec.parameters))

    async def run_async(self, *, args: dict[str, Any], tool_context: ToolContext) -> Any:
        """Run the call through dex-tasks: a result, an error the model reads, or a request
        for ADK's confirmation while a person decides in dex-tasks."""
        session_id, turn_id, call_id = dex_ids(tool_context.session,
                                                tool_context.function_call_id or "")
        record = await self.client.call_tool(
            session_id=session_id, turn_id=turn_id, tool_call_id=call_id, tool=self.name,
            arguments=args, default_effect=self.default_effect,
        )
        if record.status is CallStatus.AWAITING_APPROVAL:
            tool_context.request_confirmation(
                hint=(f"dex-tasks holds call {record.key} of {self.name} for a person's "
                      f"approval (interrupt {record.interrupt_id}); answer with "
                      "dex_confirmations once decided"),
                payload={"dex_key": record.key, "interrupt_id": record.interrupt_id},
            )
            tool_context.actions.skip_summarization = True
            return {"error": f"call {record.key} awaits a person's approval in dex-tasks"}
        if not record.terminal:
            try:
                record = await self.client.wait(record.key, timeout=self.timeout)
            except TimeoutError:
                return {"error": (f"call {record.key} is still running after "
                                  f"{self.timeout:g}s; it will not run twice")}
        return model_result(record)


def dex_adk_tools(
    client: DexClient | AsyncDexClient,
    names: Sequence[str] | None = None,
    *,
    default_effect: EffectClass | str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[BaseTool]:
    """ADK tools for the tools the workers published (all, or ``names`` in that order).

    ``default_effect`` is the session's default effect class for tools with neither a policy
    nor MCP hints. The catalog is read once, here. Raises :class:`UnknownToolError` for a name
    the catalog lacks.
    """
    dex = _async_client(client)
    specs = {spec.name: spec for spec in dex.sync.list_tools(default_effect)}
    unknown = next((name for name in names or () if name not in specs), None)
    if unknown is not None:
        raise UnknownToolError(unknown)
    chosen = list(specs.values()) if names is None else [specs[name] for name in names]
    return [DexAdkTool(dex, spec, default_effect, timeout) for spec in chosen]


async def dex_confirmations(client: DexClient | AsyncDexClient,
                            session: Session) -> types.Content | None:
    """The message that answers the session's open ADK confirmation requests of dex tools
    from the decisions people made in dex-tasks; None while none is decided yet.

    Pass it as ``new_message`` to ``runner.run_async`` (re-read the session first:
    ``await session_service.get_session(...)``). Safe to send again: a call already made is
    never started twice.
    """
    dex = _async_client(client)
    parts: list[types.Part] = []
    for call in _unanswered_confirmations(session):
        original = (call.args or {}).get("originalFunctionCall") or {}
        key = idempotency_key(*dex_ids(session, str(original.get("id") or "")))
        try:
            record = await dex.get_tool_call(key)
        except CallNotFoundError:
            continue  # not a dex tool's confirmation: the caller answers it
        if record.status is CallStatus.AWAITING_APPROVAL:
            continue
        confirmed = record.status is not CallStatus.REJECTED
        parts.append(types.Part(function_response=types.FunctionResponse(
            name=CONFIRMATION_CALL, id=call.id,
            response={"confirmed": confirmed, "payload": {"dex_key": key}},
        )))
    return types.Content(role="user", parts=parts) if parts else None


class DexAdkPlugin(BasePlugin):
    """Holds a new message sent while the session's turn is open: ``Runner(...,
    plugins=[DexAdkPlugin(client)])`` (or the ``App``'s plugins).

    A turn is open while a dex call of the session has not ended or a tool's confirmation
    request is unanswered (a call waits for a person). ADK itself would run a
    new message at once: the model would answer it in the middle of that turn, and the call
    a person approves later would finish with the conversation elsewhere. DESIGN's rule (the
    seeds' one) is that such a message is queued and delivered when the turn ends, so:

    * the message is stored in the dex session as a queued user message (its snapshot
      shows it ``queued``; delivered when the open calls end);
    * ADK has already added it to its session before any plugin runs: its text is kept
      there as a ``thought`` part, which ADK never sends to the model;
    * the run ends at once, with one event (a ``thought`` part too) that says the message
      is queued: the model is not asked.

    Once the turn has ended (the confirmation answered by :func:`dex_confirmations` and the
    model's answer given), send the message again: the model reads it then, after that
    answer. A confirmation answer is never held.
    """

    def __init__(self, client: DexClient | AsyncDexClient, *, name: str = "dex_tasks") -> None:
        super().__init__(name=name)
        self.client = _async_client(client)
        self._held: set[str] = set()  # invocations whose new message was held

    async def on_user_message_callback(self, *, invocation_context: InvocationContext,
                                       user_message: types.Content) -> types.Content | None:
        """Hold the message (see the class docstring) when the session's turn is open."""
        parts = user_message.parts or []
        if not parts or any(p.function_response is not None for p in parts):
            return None  # a confirmation (or another tool) answered: the turn goes on
        session = invocation_context.session
        if not await self._turn_open(session):
            return None
        text = "".join(p.text or "" for p in parts)
        await self.client.send_user_message(_escape(session.id), text)
        self._held.add(invocation_context.invocation_id)
        return types.Content(role=user_message.role or "user", parts=[
            types.Part(text=p.text, thought=True) if p.text else p for p in parts])

    async def before_run_callback(self, *, invocation_context: InvocationContext
                                  ) -> types.Content | None:
        """End a run whose message was held, before the model is asked."""
        if invocation_context.invocation_id not in self._held:
            return None
        self._held.discard(invocation_context.invocation_id)
        return types.Content(role="model", parts=[types.Part(thought=True, text=(
            "dex-tasks: this message is queued behind the session's open turn (a call waits "
            "for a person); the model was not asked. Send it again once that turn ended."))])

    async def _turn_open(self, session: Session) -> bool:
        snapshot = await self.client.get_agent_snapshot(_escape(session.id))
        if any(not call.terminal for call in snapshot.tool_calls):
            return True
        return bool(_unanswered_confirmations(session))


def _unanswered_confirmations(session: Session) -> list[types.FunctionCall]:
    """The session's confirmation requests nobody has answered yet."""
    answered = {response.id for event in session.events
                for response in event.get_function_responses() if response.id}
    return [call for event in session.events for call in event.get_function_calls()
            if call.name == CONFIRMATION_CALL and call.id is not None
            and call.id not in answered]


def dex_ids(session: Session, function_call_id: str) -> tuple[str, str, str]:
    """(session_id, turn_id, tool_call_id) of a function call of an ADK session."""
    invocation = None
    for event in session.events:
        if any(call.id == function_call_id for call in event.get_function_calls()):
            invocation = event.invocation_id
            break
    if not function_call_id or invocation is None:
        raise UnknownToolError(
            f"function call {function_call_id!r} is not in ADK session {session.id!r}: a dex "
            "tool runs only for a function call the session recorded")
    return _escape(session.id), _escape(invocation), _escape(function_call_id)


def dex_key(session: Session, function_call_id: str) -> str:
    """The idempotency key of one function call of an ADK session."""
    return idempotency_key(*dex_ids(session, function_call_id))


def model_result(record: ToolCallRecord) -> Any:
    """What the model reads: the result (an object as it is), else ``{"error": text}``; with
    ``"dex_arguments_edit"`` (the note) when a person approved edited arguments."""
    if record.status is CallStatus.SUCCEEDED:
        response = record.result if isinstance(record.result, dict) else {"result": record.result}
    else:
        response = {"error": record.error or f"the tool call ended {record.status.value}"}
    if record.arguments_edit:
        response = {**response, "dex_arguments_edit": record.arguments_edit}
    return response


def _escape(value: str) -> str:
    # Injective: "%" itself is encoded, so a decoded form has exactly one encoding.
    return "".join(c if _KEPT.fullmatch(c) else "".join(
        f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass")) for c in value)


def _async_client(client: DexClient | AsyncDexClient) -> AsyncDexClient:
    # One store and one publishing path: a DexClient is wrapped, never copied.
    return client if isinstance(client, AsyncDexClient) else AsyncDexClient(client=client)

