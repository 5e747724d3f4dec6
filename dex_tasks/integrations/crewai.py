"""CrewAI adapter: a crew's tools run as dex-tasks calls, the agent's model decisions are
journaled, and a call that needs approval is a tool result telling the agent it awaits a
person; running the crew again once a person decided gives the agent the outcome.

The lines a user writes (``client`` is a ``DexClient``)::

    from dex_tasks.integrations.crewai import DexCrewLLM, dex_crew_tools
    agent = Agent(role="support", goal=goal, backstory=backstory,
                  llm=DexCrewLLM(client, llm, session_id="order-1001"),
                  tools=dex_crew_tools(client, session_id="order-1001"))
    Crew(agents=[agent], tasks=[task]).kickoff()   # again, in any process, to continue

How it works:

* :func:`dex_crew_tools` builds one CrewAI ``BaseTool`` per tool of the published catalog
  (``client.list_tools()``): its name, description and an ``args_schema`` from its JSON
  schema. Running it records the call with ``call_tool`` and waits for its result, which the
  agent reads as the tool's observation (JSON); a call that failed, was rejected or whose
  outcome is unknown gives the agent ``Error: <the dex text>``.
* CrewAI's own execution ids (``Crew.id``, ``Task.id``, ``Agent.id``) are random per process,
  and its ReAct loop gives a tool call no id, so the key is built from what a run of the same
  crew code keeps: ``session / task / agent.step.tool``, where ``session`` is the
  ``session_id`` the caller names (one run of the crew, a conversation), ``task`` is the
  task's position in the crew and CrewAI's ``Task.key`` (a hash of its description and
  expected output), and the last part is CrewAI's ``Agent.key``, the agent loop's iteration
  at the call, and the tool's name. The task, agent and iteration come from CrewAI's
  ``before_tool_call`` hook (and are forgotten in ``after_tool_call``), registered once.
* So CrewAI's own retries of a tool that raised (``ToolUsage`` calls it again), a crew
  re-run after the process died, and a replayed step all reach the call already made: it is
  awaited, never started again.
* :class:`DexCrewLLM` wraps the agent's model: each task is a durable turn of the session,
  each model response of the agent loop is journaled as the turn's step before CrewAI runs the
  tool it asks for, and the final answer ends the turn. The crew run again replays the
  journaled responses instead of asking the model, so a model that would decide otherwise
  the second time cannot start a new call. (Without it, a model that answers differently on
  the re-run asks for other arguments under the same step's key; the tool tells it that this
  step's call was already made with other arguments.) While an earlier task's turn is open, a
  later task waits behind it (its input queued, its model not asked); the crew run again once
  that turn ended runs it.
* A call that needs approval is held ``awaiting_approval`` in dex-tasks for a person
  (``resolve_interrupt``, the approval page, ``dex-tasks approvals``). The tool waits up to
  ``approval_wait`` seconds (default 0) for the decision, then tells the agent that the call
  awaits a person's approval and has not run; CrewAI does not cache that observation. The
  crew finishes its task (the turn stays open) and the process may exit. Once a person
  decided, running the same crew again with the same ``session_id`` reaches the same keys:
  calls already made give their results, the approved call runs once, a rejection reaches
  the agent with the person's message. (CrewAI's ``human_input`` asks on the console at the
  end of a task, in the same process: it cannot hold one tool call across a process exit,
  so it is not used.)
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Sequence
from typing import Any

from dex_tasks.integrations.extras import needs_extra

with needs_extra("crewai", "dex_tasks.integrations.crewai"):
    from crewai import BaseLLM
    from crewai.agents.parser import AgentFinish, OutputParserError, parse
    from crewai.events.listeners.tracing.trace_listener import TraceCollectionListener
    from crewai.hooks import register_after_tool_call_hook, register_before_tool_call_hook
    from crewai.hooks.tool_hooks import ToolCallHookContext
    from crewai.tools import BaseTool
    from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, create_model

from dex_tasks import (
    CallStatus,
    ConflictError,
    DexClient,
    EffectClass,
    ToolCallRecord,
    ToolSpec,
    Turn,
    TurnConflictError,
    UnknownToolError,
    idempotency_key,
    key_part,
)

__all__ = ["DEFAULT_TIMEOUT", "WAITING_TASK", "DexCrewLLM", "DexCrewTool", "dex_crew_tools",
           "dex_ids"]

DEFAULT_TIMEOUT = 120.0
"""Seconds a tool call waits for its dex call to end before it tells the agent it still runs."""

WAITING_TASK = "This task has not started:"
"""How the answer of a task that waits behind an earlier task's open turn begins."""

_JSON_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float,
                               "boolean": bool, "array": list, "object": dict}


class _Step:
    """Where a crew is when it calls a tool: what the key is built from."""

    def __init__(self, task: Any, agent: Any, crew: Any) -> None:
        self.task, self.agent, self.crew = task, agent, crew
        executor = getattr(agent, "agent_executor", None)
        self.iteration = int(getattr(executor, "iterations", 0) or 0)


_current: contextvars.ContextVar[_Step | None] = contextvars.ContextVar(
    "dex_crewai_step", default=None)
_hook_lock = threading.Lock()
_hook_registered = False


def _remember_step(context: ToolCallHookContext) -> None:
    # CrewAI calls its before-tool-call hooks in the thread that then runs the tool.
    if isinstance(getattr(context.tool, "_original_tool", None), DexCrewTool):
        _current.set(_Step(context.task, context.agent, context.crew))


def _forget_step(context: ToolCallHookContext) -> None:
    # After the call (CrewAI's own retries included): a tool run outside a crew gets no key.
    if isinstance(getattr(context.tool, "_original_tool", None), DexCrewTool):
        _current.set(None)


def _register_hooks() -> None:
    global _hook_registered
    with _hook_lock:
        if not _hook_registered:
            register_before_tool_call_hook(_remember_step)
            register_after_tool_call_hook(_forget_step)
            _hook_registered = True
    _no_trace_prompt()


def _no_trace_prompt() -> None:
    """Turn off CrewAI's first-run prompt in this process.

    After a crew's first run on a machine, CrewAI asks on the console whether to view its
    execution traces and waits 20 s for an answer (CrewAI 1.6's ``FirstTimeTraceHandler``,
    decided once per process by its trace listener). A dex crew runs in an agent process,
    run again after a person decided, with nobody at its console: every run on a fresh
    machine, container or CI job stopped 20 s there. Tracing itself is left as configured
    (``Crew(tracing=...)``, ``CREWAI_TRACING_ENABLED``); nothing is written to CrewAI's user
    file, so its own CLI still asks where it is used by hand.
    """
    TraceCollectionListener().first_time_handler.is_first_time = False


class DexCrewTool(BaseTool):
    """One published dex tool as a CrewAI tool (built by :func:`dex_crew_tools`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    session_id: str = Field(description="The dex session of the crew's run.")
    timeout: float = DEFAULT_TIMEOUT
    approval_wait: float = 0.0
    _client: DexClient = PrivateAttr()
    _default_effect: EffectClass | str | None = PrivateAttr(default=None)
    _required: frozenset[str] = PrivateAttr(default=frozenset())

    def _run(self, **arguments: Any) -> str:
        arguments = {name: value for name, value in arguments.items()
                     if value is not None or name in self._required}
        step = _current.get()
        if step is None:
            return ("Error: a dex-tasks tool runs only inside a crew's task (its key comes from "
                    "the task, the agent and the step); it has not run")
        session_id, turn_id, call_id = dex_ids(self.session_id, step.task, step.agent,
                                               step.crew, step.iteration, self.name)
        try:
            record = self._client.call_tool(
                session_id=session_id, turn_id=turn_id, tool_call_id=call_id, tool=self.name,
                arguments=arguments, default_effect=self._default_effect)
        except ConflictError as err:
            return (f"Error: {err}. This step's call of {self.name} was already made with "
                    "other arguments; it has not run again")
        if record.status is CallStatus.AWAITING_APPROVAL and self.approval_wait > 0:
            record = self._wait(record, self.approval_wait)
        if record.status is CallStatus.AWAITING_APPROVAL:
            return (f"Error: the tool has not run: call {record.key} of {self.name} awaits a "
                    f"person's approval in dex-tasks (interrupt {record.interrupt_id}). Do not "
                    "call it again now: say in your final answer that it awaits approval; the "
                    "crew is run again once a person decided")
        record = self._wait(record, self.timeout)
        if not record.terminal:
            return (f"Error: call {record.key} is still {record.status.value} after "
                    f"{self.timeout:g}s; it will not run twice")
        return observation(record)

    def to_structured_tool(self) -> Any:
        # CrewAI 1.6 builds the tool it runs without the cache_function (so it caches every
        # result): "awaits approval" would be served again for the same input.
        structured = super().to_structured_tool()
        setattr(structured, "cache_function", self.cache_function)  # noqa: B010
        return structured

    def _wait(self, record: ToolCallRecord, timeout: float) -> ToolCallRecord:
        if record.terminal:
            return record
        try:
            return self._client.wait(record.key, timeout=timeout)
        except TimeoutError:
            return self._client.get_tool_call(record.key)


def _cache_only_outcomes(_arguments: Any, result: Any) -> bool:
    # CrewAI's tool cache may keep an outcome; "awaits approval" or "still running" must be
    # asked again.
    return not str(result).startswith("Error: ")


def dex_crew_tools(
    client: DexClient,
    names: Sequence[str] | None = None,
    *,
    session_id: str,
    default_effect: EffectClass | str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    approval_wait: float = 0.0,
) -> list[BaseTool]:
    """CrewAI tools for the tools the workers published (all, or ``names`` in that order),
    their calls made in the dex session ``session_id`` (one run of the crew).

    ``default_effect`` is the session's default effect class for tools with neither a policy
    nor MCP hints; ``timeout`` bounds the wait for a call's result; ``approval_wait`` is how
    long a call that needs approval waits for the decision before the agent is told it awaits
    one. The catalog is read once, here. Raises :class:`UnknownToolError` for a name the
    catalog lacks.
    """
    _register_hooks()
    specs = {spec.name: spec for spec in client.list_tools(default_effect)}
    unknown = next((name for name in names or () if name not in specs), None)
    if unknown is not None:
        raise UnknownToolError(unknown)
    chosen = list(specs.values()) if names is None else [specs[name] for name in names]
    return [_tool(client, spec, session_id, default_effect, timeout, approval_wait)
            for spec in chosen]


def _tool(client: DexClient, spec: ToolSpec, session_id: str,
          default_effect: EffectClass | str | None, timeout: float,
          approval_wait: float) -> DexCrewTool:
    tool = DexCrewTool(name=spec.name, description=spec.description or spec.name,
                       args_schema=_args_model(spec), session_id=session_id, timeout=timeout,
                       approval_wait=approval_wait, cache_function=_cache_only_outcomes)
    tool._client = client
    tool._default_effect = default_effect
    tool._required = frozenset(spec.parameters.get("required", ()))
    return tool


def _args_model(spec: ToolSpec) -> type[BaseModel]:
    """A pydantic model of the tool's top-level parameters (CrewAI shows and checks it; the
    JSON schema itself is checked by dex-tasks)."""
    required = set(spec.parameters.get("required", ()))
    fields: dict[str, Any] = {}
    for name, given in (spec.parameters.get("properties") or {}).items():
        schema: dict[str, Any] = given if isinstance(given, dict) else {}
        json_type = schema.get("type")
        kind = _JSON_TYPES.get(json_type, Any) if isinstance(json_type, str) else Any
        description = schema.get("description")
        if name in required:
            fields[name] = (kind, Field(description=description))
        else:
            fields[name] = (kind | None, Field(default=schema.get("default"),
                                               description=description))
    model: type[BaseModel] = create_model(f"{spec.name}_arguments", **fields)
    return model


def dex_ids(session_id: str, task: Any, agent: Any, crew: Any, iteration: int,
            tool: str) -> tuple[str, str, str]:
    """(session_id, turn_id, tool_call_id) of a crew's tool call: the session, the task (its
    position in the crew and CrewAI's ``Task.key``) and ``agent key.iteration.tool``."""
    tasks = list(getattr(crew, "tasks", None) or [])
    position = next((str(i) for i, t in enumerate(tasks) if t is task), "-")
    task_key = getattr(task, "key", None) or "no-task"
    agent_key = getattr(agent, "key", None) or "no-agent"
    return (key_part(session_id), key_part(f"{position}.{task_key}"),
            key_part(f"{agent_key}.{iteration}.{tool}"))


def dex_key(session_id: str, task: Any, agent: Any, crew: Any, iteration: int,
            tool: str) -> str:
    """The idempotency key of a crew's tool call (see :func:`dex_ids`)."""
    return idempotency_key(*dex_ids(session_id, task, agent, crew, iteration, tool))


class DexCrewLLM(BaseLLM):
    """The agent's model with its decisions journaled in dex-tasks: ``llm=DexCrewLLM(client,
    llm, session_id=...)`` (the same ``session_id`` as the agent's :func:`dex_crew_tools`).

    Each task is a durable turn of the session (its id is the tools' ``task`` key part, its
    input the task's prompt); each model response of the agent loop is journaled as the turn's
    step at the loop's iteration before CrewAI runs the tool it asks for, and the final answer
    ends the turn. Running the same crew again with the same session replays the journaled
    responses instead of asking the model (so the tools get the same keys), and a task whose
    turn ended gives its answer again. A final answer given while a call of the task awaits
    a person's approval is not journaled: the turn stays open, so the crew run again once the
    person decided asks the model again with the call's outcome. While an earlier task's turn
    is open, a later task waits: its input (the task's description) is queued, the model is
    not asked, and its answer begins with :data:`WAITING_TASK`; the crew run again once that
    turn ended runs it, journaled, its turn begun from the queued input.
    """

    _inner: BaseLLM

    def __init__(self, client: DexClient, llm: BaseLLM, *, session_id: str) -> None:
        self.__dict__["_inner"] = llm  # before BaseLLM's __init__ sets ``stop``
        super().__init__(model=getattr(llm, "model", None) or "dex-journaled",
                         temperature=getattr(llm, "temperature", None))
        self.client, self.session_id = client, session_id
        _no_trace_prompt()

    @property  # type: ignore[override]
    def stop(self) -> list[str]:
        stop: list[str] = getattr(self._inner, "stop", None) or []
        return stop

    @stop.setter
    def stop(self, value: list[str]) -> None:
        # CrewAI's executor adds its stop words to the agent's model: the model's own.
        self._inner.stop = value

    def supports_stop_words(self) -> bool:
        return bool(self._inner.supports_stop_words())

    def supports_function_calling(self) -> bool:
        return False  # the ReAct loop: the responses journaled are its text

    def get_context_window_size(self) -> int:
        return int(self._inner.get_context_window_size())

    def call(self, messages: Any, tools: Any = None, callbacks: Any = None,
             available_functions: Any = None, from_task: Any = None, from_agent: Any = None,
             response_model: Any = None) -> str | Any:
        def ask() -> Any:
            return self._inner.call(messages, tools=tools, callbacks=callbacks,
                                    available_functions=available_functions,
                                    from_task=from_task, from_agent=from_agent,
                                    response_model=response_model)

        executor = getattr(from_agent, "agent_executor", None)
        prompt = _first_user_text(messages)
        if from_task is None or executor is None or not prompt:
            return ask()  # not an agent loop's step (planning, a summary): not journaled
        step = int(getattr(executor, "iterations", 0) or 0)
        session_id, turn_id, _ = dex_ids(self.session_id, from_task, from_agent,
                                         getattr(from_agent, "crew", None), step, "-")
        turn = self._begin(session_id, turn_id, from_task, prompt)
        if turn.queued_input:
            # An earlier task's turn is open (a call of it awaits a person): this task waits
            # behind it, its input queued as a message sent during a turn is, and the model
            # is not asked. The crew run again once that turn ended runs it, journaled.
            return ("Thought: this task must wait for an earlier one\nFinal Answer: "
                    f"{WAITING_TASK} turn {turn.turn_id!r} of this session ({turn.input!r}) "
                    "is still open, a call of it awaiting a person; this task is queued "
                    "behind it and runs when the crew is run again after it ended")
        if not turn.open:
            return f"Thought: I already answered\nFinal Answer: {turn.answer}"
        if step < len(turn.steps):
            replayed: str = json.loads(turn.steps[step].response)["text"]
            return replayed
        answer = ask()
        if not isinstance(answer, str):
            return answer
        try:
            parsed = parse(answer)
        except OutputParserError:
            parsed = None
        if isinstance(parsed, AgentFinish):
            if not self._awaiting(session_id, turn_id):
                self.client.end_turn(session_id, turn_id, str(parsed.output),
                                     response=json.dumps({"text": answer}))
        else:
            self.client.record_step(session_id, turn_id, step, json.dumps({"text": answer}),
                                    [], text=answer)
        return answer

    def _begin(self, session_id: str, turn_id: str, task: Any, prompt: str) -> Turn:
        """Begin (or continue) the task's turn. Its input is the task's description: its
        prompt also carries the earlier tasks' outputs, which change once an earlier turn it
        waited behind has ended, and the queued input must be known again when the crew is
        run again (:meth:`DexClient.begin_turn` begins the turn from it)."""
        text = str(getattr(task, "description", "") or "").strip() or prompt
        try:
            return self.client.begin_turn(session_id, text, turn_id=turn_id)
        except TurnConflictError:
            # A turn begun by an earlier release, whose input was the task's whole prompt.
            return self.client.begin_turn(session_id, prompt, turn_id=turn_id)

    def _awaiting(self, session_id: str, turn_id: str) -> bool:
        snapshot = self.client.get_agent_snapshot(session_id)
        return any(p.key.split("/")[1] == turn_id for p in snapshot.pending_interrupts)


def _first_user_text(messages: Any) -> str:
    if isinstance(messages, str):
        return messages
    return next((str(m.get("content") or "") for m in messages or ()
                 if isinstance(m, dict) and m.get("role") == "user"), "")


def observation(record: ToolCallRecord) -> str:
    """What the agent reads: the result as JSON, else ``Error: <the dex text>``."""
    if record.status is CallStatus.SUCCEEDED:
        return json.dumps(record.result, sort_keys=True, default=str)
    return f"Error: {record.error or f'the tool call ended {record.status.value}'}"
