"""Existing framework tools served as dex tools, with no rewrite: for a worker's ``--tools``.

    # my_tools.py, served by: dex-tasks worker --tools my_tools
    from dex_tasks.integrations.framework_tools import from_framework_tools
    from shop.agent_tools import lookup_order, refund_payment   # @tool / @function_tool / plain

    from_framework_tools([lookup_order, refund_payment],
                         policies={"lookup_order": "read",
                                   "refund_payment": "non_idempotent_write"})

Each tool keeps its name, its JSON schema and its description; a Google-style ``Args:``
section of the docstring gives each parameter without one its description (and leaves the
description the model reads without it). Understood:

* a LangChain tool (``@tool`` from ``langchain_core.tools``, any ``BaseTool``): run with
  ``tool.invoke(arguments)`` (``ainvoke`` for an async-only tool), so its own argument checks
  and injected parameters apply;
* an OpenAI Agents SDK ``@function_tool``: its schema and description as the SDK built them,
  run by calling the decorated function (``FunctionTool.__wrapped__``);
* a Pydantic AI tool: a ``pydantic_ai.Tool`` or a plain function (Pydantic AI's schema and
  docstring parsing make its schema), run by calling the function.

A tool that takes its framework's run context (a Pydantic AI ``RunContext``, an SDK
``RunContextWrapper``/``ToolContext``) is refused: that context lives in the agent process,
not on a worker. Each framework is imported only when one of its tools is given.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dex_tasks import EffectClass, Tool, ToolContext, ToolDefinitionError, ToolPolicy, define_tool

__all__ = ["from_framework_tool", "from_framework_tools", "parse_args_section"]

Policy = ToolPolicy | EffectClass | str


@dataclass(frozen=True)
class _Found:
    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[dict[str, Any]], Any]


def from_framework_tool(tool: Any, *, name: str | None = None,
                        policy: Policy | None = None) -> Tool[Any]:
    """Define one dex tool from a LangChain, OpenAI Agents SDK or Pydantic AI tool.

    ``name`` overrides the tool's own; ``policy`` is its effect class (``"read"``, an
    :class:`EffectClass`) or a whole :class:`ToolPolicy`. Raises :class:`ToolDefinitionError`
    naming the tool for one it cannot serve.
    """
    found = _inspect(tool)
    parameters = dict(found.parameters)
    description = found.description
    described = parse_args_section(description)
    if described:
        properties = {key: dict(value) for key, value in
                      (parameters.get("properties") or {}).items()}
        for param, text in described.items():
            if param in properties and not properties[param].get("description"):
                properties[param]["description"] = text
        parameters["properties"] = properties
        description = _without_args_section(description)
    options = _policy_options(found.name, policy)

    def run(ctx: ToolContext, arguments: dict[str, Any]) -> Any:
        return found.run(arguments)

    return define_tool(name or found.name, parameters, run, description=description or None,
                       **options)


def from_framework_tools(tools: Iterable[Any], *,
                         policies: Mapping[str, Policy] | None = None) -> list[Tool[Any]]:
    """:func:`from_framework_tool` for each of ``tools``; ``policies`` maps a tool's name to
    its policy (a name ``policies`` gives that is not one of the tools is an error)."""
    given = dict(policies or {})
    defined = []
    for tool in tools:
        found_name = _inspect(tool).name
        defined.append(from_framework_tool(tool, policy=given.pop(found_name, None)))
    if given:
        raise ToolDefinitionError(
            f"from_framework_tools: policies names {sorted(given)!r}, which are not among the "
            f"tools given ({sorted(t.name for t in defined)!r})")
    return defined


# -- Args: sections ----------------------------------------------------------------------------

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters)\s*:\s*$")
_ENTRY = re.compile(r"^\**(\w+)\**\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_OTHER_SECTION = re.compile(
    r"^\s*(Returns|Return|Yields|Raises|Examples?|Notes?|Warnings?|See Also)\s*:\s*$")


def parse_args_section(docstring: str | None) -> dict[str, str]:
    """Each parameter's description from a Google-style ``Args:`` section (continuation lines
    indented under an entry join it); empty when there is none."""
    lines = inspect.cleandoc(docstring or "").splitlines()
    found: dict[str, str] = {}
    inside, indent, current = False, None, None
    for line in lines:
        if not inside:
            inside = bool(_SECTION.match(line))
            continue
        if not line.strip():
            continue
        if _OTHER_SECTION.match(line) or (line[:1].strip() and indent is not None):
            break  # the next section, or text back at the margin
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        entry = _ENTRY.match(line.strip())
        if width == indent and entry:
            current = entry[1]
            found[current] = entry[2].strip()
        elif width > indent and current is not None:
            found[current] = f"{found[current]} {line.strip()}".strip()
        else:
            break
    return found


def _without_args_section(docstring: str) -> str:
    lines = inspect.cleandoc(docstring).splitlines()
    for i, line in enumerate(lines):
        if _SECTION.match(line):
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or lines[end][:1].isspace()):
                end += 1
            return "\n".join(lines[:i] + lines[end:]).strip()
    return docstring.strip()


# -- the frameworks ---------------------------------------------------------------------------


def _inspect(tool: Any) -> _Found:
    module = type(tool).__module__
    if module.startswith("langchain"):
        return _langchain(tool)
    if module.startswith("agents"):
        return _openai(tool)
    if module.startswith("pydantic_ai") or callable(tool):
        return _pydantic_ai(tool)
    raise ToolDefinitionError(
        f"{tool!r} is not a LangChain tool, an OpenAI Agents SDK function tool, a Pydantic "
        "AI tool or a function")


def _await(value: Any) -> Any:
    # A worker's tool runs in a thread of its own with no event loop: run the coroutine there.
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value
    return asyncio.run(wait())


def _langchain(tool: Any) -> _Found:
    from langchain_core.tools import BaseTool
    from langchain_core.utils.function_calling import convert_to_openai_tool

    if not isinstance(tool, BaseTool):
        raise ToolDefinitionError(f"{tool!r} is not a LangChain BaseTool")
    spec = convert_to_openai_tool(tool)["function"]
    parameters = spec.get("parameters") or {"type": "object", "properties": {}}
    sync = getattr(tool, "func", None) is not None or type(tool)._run is not BaseTool._run

    def run(arguments: dict[str, Any]) -> Any:
        return tool.invoke(arguments) if sync else asyncio.run(tool.ainvoke(arguments))

    return _Found(tool.name, tool.description or "", parameters, run)


def _openai(tool: Any) -> _Found:
    from agents import FunctionTool

    if not isinstance(tool, FunctionTool):
        raise ToolDefinitionError(
            f"{tool!r} is not an OpenAI Agents SDK FunctionTool: only @function_tool tools "
            "(whose Python function a worker can call) are served")
    try:
        fn: Callable[..., Any] = tool.__wrapped__
    except AttributeError as err:
        raise ToolDefinitionError(
            f"OpenAI tool {tool.name!r} was not made by @function_tool: a worker has no "
            "function of it to call") from err
    from agents.function_schema import function_schema

    properties = set(tool.params_json_schema.get("properties") or {})
    _refuse_context(tool.name, fn, properties)
    # The tool's schema before the SDK made it strict (strict makes every argument required,
    # defaults included): the worker must accept what the function accepts.
    parameters = function_schema(fn, name_override=tool.name,
                                 strict_json_schema=False).params_json_schema

    def run(arguments: dict[str, Any]) -> Any:
        return _await(fn(**arguments))

    return _Found(tool.name, tool.description or "", dict(parameters), run)


def _pydantic_ai(tool: Any) -> _Found:
    try:
        from pydantic_ai import Tool as PydanticTool
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ToolDefinitionError(
            f"{tool!r}: a plain function is read as a Pydantic AI tool function, which needs "
            'the pydantic-ai extra (pip install "dex-tasks[pydantic-ai]"); or decorate it '
            "with dex_tasks.tool") from err
    wrapped = tool if isinstance(tool, PydanticTool) else PydanticTool(tool)
    if wrapped.takes_ctx:
        raise ToolDefinitionError(
            f"Pydantic AI tool {wrapped.name!r} takes a RunContext, which lives in the agent "
            "process: a worker cannot give it one; serve a function without it")
    fn: Callable[..., Any] = wrapped.function

    def run(arguments: dict[str, Any]) -> Any:
        return _await(fn(**arguments))

    return _Found(wrapped.name, wrapped.description or "",
                  dict(wrapped.function_schema.json_schema), run)


def _refuse_context(name: str, fn: Callable[..., Any], properties: set[str]) -> None:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if params and params[0].name not in properties:
        raise ToolDefinitionError(
            f"tool {name!r} takes its framework's run context ({params[0].name!r}), which "
            "lives in the agent process: a worker cannot give it one; serve a function "
            "without it")


def _policy_options(name: str, policy: Policy | None) -> dict[str, Any]:
    if policy is None:
        return {}
    if isinstance(policy, ToolPolicy):
        return {"effect": policy.effect, "requires_approval": policy.requires_approval,
                "max_attempts": policy.max_attempts, "time_limit": policy.time_limit,
                "approval_deadline": policy.approval_deadline}
    try:
        return {"effect": EffectClass(policy)}
    except ValueError as err:
        raise ToolDefinitionError(
            f"tool {name!r}: {policy!r} is not an effect class "
            f"({', '.join(e.value for e in EffectClass)})") from err
