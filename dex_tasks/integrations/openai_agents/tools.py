"""``dex_function_tools``: the published catalog as the SDK's ``FunctionTool``s, each
invocation a dex call.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agents import AgentsException, FunctionTool, RunContextWrapper, Tool
from agents.strict_schema import ensure_strict_json_schema
from agents.tool_context import ToolContext

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    ApprovalRule,
    AsyncDexClient,
    CallStatus,
    DexClient,
    DexError,
    EffectClass,
    InvalidArguments,
    ToolCallRecord,
    ToolPolicy,
    ToolSpec,
    UnknownToolError,
    normalize_arguments,
    tool_message_text,
)
from dex_tasks.integrations.openai_agents.context import async_client, call_ids

DEFAULT_TIMEOUT = 120.0
"""Seconds a tool invocation waits for its call to end before it raises ``TimeoutError``."""


class ApprovalPendingError(DexError, AgentsException):
    """A tool was invoked while dex-tasks still holds its call for a person's approval.

    This happens when the SDK was told to run a call without dex-tasks having approved it:
    ``state.approve`` called directly instead of :func:`apply_dex_decisions`, or a policy that
    started to need approval after the tools were built. The tool does not run; decide the
    interrupt, then apply the decisions and resume. An ``AgentsException``, so the SDK passes
    it on as it is (not as a ``UserError``); under :func:`dex_run_config` the turn is in the
    store, and running the same ``Runner.run`` again continues it.
    """


class CallStillRunningError(DexError, AgentsException):
    """A tool's call had not ended when the invocation stopped waiting (``timeout``).

    The call goes on on its worker and ends on its own. Under :func:`dex_run_config`, run the
    same ``Runner.run`` again (same session, same input): the turn continues from the store
    and the invocation waits for the same call, which never starts twice.
    """


def dex_function_tools(
    client: DexClient | AsyncDexClient,
    names: Sequence[str] | None = None,
    *,
    default_effect: EffectClass | str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[Tool]:
    """``FunctionTool``s for the tools the workers published (all, or ``names`` in that order).

    Each invocation runs the call through dex-tasks and waits up to ``timeout`` seconds for its
    result. ``default_effect`` is the session's default effect class for tools that have
    neither a policy nor MCP hints (``list_tools`` and ``call_tool`` take the same). The
    catalog is read once, here (a short blocking read): build the tools again to pick up
    policy changes. Raises :class:`UnknownToolError` for a name the catalog lacks.
    """
    dex = async_client(client)
    specs = {spec.name: spec for spec in dex.sync.list_tools(default_effect)}
    if names is None:
        chosen = list(specs.values())
    else:
        missing = [name for name in names if name not in specs]
        if missing:
            raise UnknownToolError(missing[0])
        chosen = [specs[name] for name in names]
    return [_function_tool(dex, spec, default_effect, timeout) for spec in chosen]


# -- the tool -----------------------------------------------------------------------------------


class DexInvoker:
    """``FunctionTool.on_invoke_tool`` of a dex tool: run the call through dex-tasks, wait."""

    def __init__(self, client: AsyncDexClient, tool: str,
                 default_effect: EffectClass | str | None, timeout: float) -> None:
        self.client = client
        self.tool = tool
        self.default_effect = default_effect
        self.timeout = timeout

    async def __call__(self, ctx: ToolContext[Any], input: str) -> str:
        arguments = parse_arguments(input)
        if isinstance(arguments, str):
            return arguments
        session_id, turn_id, tool_call_id = call_ids(ctx.context, ctx.tool_call_id)
        record = await self.client.call_tool(
            session_id=session_id, turn_id=turn_id, tool_call_id=tool_call_id, tool=self.tool,
            arguments=arguments, default_effect=self.default_effect,
        )
        if record.status is CallStatus.AWAITING_APPROVAL:
            raise ApprovalPendingError(
                f"call {record.key} of {self.tool!r} awaits a person's approval in dex-tasks "
                f"(interrupt {record.interrupt_id}); decide it, then call apply_dex_decisions "
                "and resume the run"
            )
        if not record.terminal:
            try:
                record = await self.client.wait(record.key, timeout=self.timeout)
            except TimeoutError as err:
                raise CallStillRunningError(
                    f"call {record.key} of {self.tool!r} has not ended after {self.timeout}s; "
                    "it goes on on its worker. Run the same Runner.run again (same session "
                    "and input, run_config=dex_run_config(client)) to keep waiting: the turn "
                    "continues from the store and the call never starts twice"
                ) from err
        return model_text(record)


def _function_tool(client: AsyncDexClient, spec: ToolSpec,
                   default_effect: EffectClass | str | None, timeout: float) -> FunctionTool:
    schema = copy.deepcopy(spec.parameters)
    return FunctionTool(
        name=spec.name,
        description=spec.description,
        params_json_schema=schema,
        on_invoke_tool=DexInvoker(client, spec.name, default_effect, timeout),
        strict_json_schema=_already_strict(schema),
        needs_approval=_needs_approval(spec.policy, spec.name, spec.parameters),
    )


def _needs_approval(policy: ToolPolicy, name: str, schema: dict[str, Any]
                    ) -> bool | Callable[..., Awaitable[bool]]:
    """``needs_approval`` for a tool with this dex policy: a flag, or for a rule on the
    arguments the SDK's callable, which asks the rule (``ToolPolicy.approval_for``, the very
    evaluation ``call_tool`` makes from the catalog's policy) on the arguments normalized as
    ``call_tool`` normalizes them (``dex_tasks.arguments``: ``"true"`` for ``true``, defaults
    filled in), so that only the calls the rule sends to a person pause the run. A rule that
    cannot be evaluated pauses it (fail closed); arguments the schema refuses do not (the
    call is refused, unrun, by ``call_tool``)."""
    if not isinstance(policy.requires_approval, ApprovalRule):
        return policy.needs_approval

    async def asks_the_rule(_ctx: RunContextWrapper[Any], arguments: dict[str, Any],
                            _call_id: str) -> bool:
        try:
            normalized = normalize_arguments(name, schema, arguments)
        except InvalidArguments:
            return False
        return policy.approval_for(normalized).required

    return asks_the_rule


def _already_strict(schema: dict[str, Any]) -> bool:
    """True when the SDK's strict conversion leaves the schema as it is.

    Strict mode makes every property required and forbids undeclared ones; a catalog schema
    with optional arguments (a default) or open objects would accept less than the tool does,
    so those tools are sent non-strict (the worker still checks the arguments).
    """
    try:
        return ensure_strict_json_schema(copy.deepcopy(schema)) == schema
    except Exception:  # noqa: BLE001 - any refusal of the converter means "not strict"
        return False


def model_text(record: ToolCallRecord) -> str:
    """What the model reads: the result as JSON text, else the call's error; after the edit
    note when a person approved edited arguments."""
    return tool_message_text(record)


def _reject_constant(value: str) -> Any:
    raise ValueError(f"{value} is not JSON")


def parse_arguments(text: str) -> dict[str, Any] | str:
    """The model's arguments as a dict, or the text that tells the model why not."""
    if not text.strip():
        return {}
    try:
        # NaN and Infinity are not JSON: refuse them here, as the store would.
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError as err:
        return f"{TOOL_DID_NOT_RUN}: the arguments are not valid JSON ({err})"
    if not isinstance(value, dict):
        return (f"{TOOL_DID_NOT_RUN}: the arguments must be a JSON object, "
                f"got {type(value).__name__}")
    return value
