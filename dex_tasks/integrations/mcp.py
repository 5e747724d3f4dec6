"""An MCP server's tools as dex tools, for a worker's ``--tools`` module.

    # shop_tools.py; run it with: dex-tasks worker --tools shop_tools
    from dex_tasks.integrations.mcp import mcp_tools

    mcp_tools(["python", "shop_server.py"], prefix="shop_",
              policies={"refund": "non_idempotent_write"})

``mcp_tools(server)`` lists the tools of an MCP server (a command to run over stdio, or the URL
of a streamable HTTP endpoint) when the module is imported, and defines one dex tool per MCP
tool: its name (``prefix`` + the MCP name), description and input schema. Its policy comes from
``policies`` (explicit, it wins), else from the server's annotations (``readOnlyHint``,
``idempotentHint``, ``destructiveHint``: hints from the tool's author, used only when no policy
is given), else it is ``unclassified`` (one attempt, approval first). Agent processes call the
tools by their dex names; the catalog the worker publishes carries their schemas and policies.

Calls run over one long-lived MCP session per worker process, which reconnects when the server
restarts (:mod:`dex_tasks.integrations.mcp_session`). Each request carries the call's
idempotency key in its ``_meta`` (``"dex/idempotency_key"``), so a server that understands it
can drop duplicates. What the call ends as:

* the tool's ``structuredContent``, else its text content (a JSON object or array in text is
  parsed), is the call's result;
* a result with ``isError``: ``failed`` with the tool's text (:class:`MCPToolError`); a
  JSON-RPC error from the server (unknown tool, refused arguments): ``failed``
  (:class:`MCPServerError`);
* the session broke before the request reached the server: sent again on a fresh session, else
  a retryable "the tool did not run" error;
* the session broke after the request was sent (the server was killed mid-call), or no answer
  within ``timeout``: ``outcome_unknown``, never run again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from dex_tasks import EffectClass, Tool, ToolContext, ToolDefinitionError, ToolPolicy, define_tool
from dex_tasks.integrations.extras import needs_extra

with needs_extra("mcp", "dex_tasks.integrations.mcp"):
    from mcp import StdioServerParameters
    from mcp.types import CallToolResult, TextContent
    from mcp.types import Tool as MCPTool

from dex_tasks.integrations.mcp_session import (
    IDEMPOTENCY_META_KEY,
    MCPServerError,
    ServerConnection,
)

__all__ = [
    "IDEMPOTENCY_META_KEY",
    "MCPServerError",
    "MCPToolError",
    "close_sessions",
    "mcp_tools",
]

log = logging.getLogger("dex_tasks.integrations.mcp")

_HINT_KEYS = ("readOnlyHint", "idempotentHint", "destructiveHint", "openWorldHint")


class MCPToolError(Exception):
    """The MCP tool ran and reported an error (a result with ``isError``); its text is the
    message. The call ends ``failed`` with it, which is what the model reads."""


# -- results ------------------------------------------------------------------------------------


def _result_value(result: CallToolResult) -> Any:
    """The JSON result of a call: structured content, else the content blocks."""
    if result.is_error:
        texts = [b.text for b in result.content if isinstance(b, TextContent)]
        raise MCPToolError("\n".join(texts) or "the MCP tool reported an error without text")
    if result.structured_content is not None:
        return result.structured_content
    values = [_block_value(block) for block in result.content]
    return values[0] if len(values) == 1 else values


def _block_value(block: Any) -> Any:
    if isinstance(block, TextContent):
        text = block.text
        if text.lstrip().startswith(("{", "[")):
            try:
                return json.loads(text)
            except ValueError:
                pass
        return text
    # Images, audio, embedded resources: their JSON form as MCP sends it.
    return block.model_dump(mode="json", by_alias=True, exclude_none=True)


# -- defining the tools -------------------------------------------------------------------------

_defined: dict[str, str] = {}
_servers: list[ServerConnection] = []


def close_sessions() -> None:
    """Close this process's MCP sessions and their threads (stdio servers exit with them).

    Calls made afterwards open new sessions. For a clean shutdown, or tests; a worker process
    that simply exits needs no call: its stdio servers see their input close and exit.
    """
    for target in _servers:
        target.close()


def mcp_tools(
    server: str | Sequence[str] | StdioServerParameters,
    *,
    prefix: str = "",
    policies: Mapping[str, ToolPolicy | EffectClass | str] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    connect_timeout: float = 30.0,
) -> list[Tool[Any]]:
    """Define one dex tool per tool of an MCP server; call it in a worker's ``--tools`` module.

    ``server``: a URL (``http://`` or ``https://``, streamable HTTP), a command (``"python
    server.py"`` or ``["python", "server.py"]``) run over stdio, or ``mcp.StdioServerParameters``
    (to give it an environment or a working directory: a stdio server inherits only ``PATH``,
    ``HOME`` and a few such variables, never the worker's secrets).

    ``prefix`` goes before every MCP tool name to make its dex name. ``policies`` maps tool
    names (the MCP name, or the prefixed dex name) to a :class:`~dex_tasks.ToolPolicy` or an
    effect class; a tool without one gets the policy its annotations give, else
    ``unclassified``. ``headers`` are sent with every HTTP request (e.g. authorization).
    ``timeout``: seconds to wait for a call's answer before it ends ``outcome_unknown``;
    ``connect_timeout``: seconds to open a session.

    The tools are listed now, over a session that is closed before this returns. Returns the
    dex tools, registered in this process. Raises :class:`~dex_tasks.ToolDefinitionError` when
    the server cannot be listed, a policy names no tool of the server, or a name is taken.
    """
    if not isinstance(prefix, str):
        raise ToolDefinitionError(f"mcp_tools: prefix must be a string, got {prefix!r}")
    given = _checked_policies(policies or {})
    target = ServerConnection(server, headers, timeout, connect_timeout)
    listed = target.list_tools()
    _servers.append(target)
    chosen = _by_tool(target.label, prefix, listed, given)
    for spec in listed:
        owner = _defined.get(prefix + spec.name)
        if owner is not None:
            raise ToolDefinitionError(
                f"mcp_tools: tool {prefix + spec.name!r} of {target.label} is already defined "
                f"by {owner}; give one of the servers a prefix="
            )
    tools: list[Tool[Any]] = []
    for spec in listed:
        tools.append(_define(target, prefix + spec.name, spec, chosen.get(spec.name)))
        _defined[prefix + spec.name] = target.label
    log.info("MCP tools defined", extra={"action": "mcp_tools_defined",
                                         "server": target.label, "tools": len(tools)})
    return tools


def _checked_policies(
    given: Mapping[str, ToolPolicy | EffectClass | str],
) -> dict[str, ToolPolicy]:
    """``given`` with every value made a ToolPolicy (checked before the server is contacted)."""
    checked: dict[str, ToolPolicy] = {}
    for key, value in given.items():
        try:
            # ToolPolicy takes an effect's name too, and names a bad one in its error.
            checked[key] = (value if isinstance(value, ToolPolicy)
                            else ToolPolicy(effect=cast(EffectClass, value)))
        except Exception as err:
            raise ToolDefinitionError(f"mcp_tools: policies[{key!r}]: {err}") from err
    return checked


def _by_tool(label: str, prefix: str, listed: list[MCPTool],
             given: dict[str, ToolPolicy]) -> dict[str, ToolPolicy]:
    """``given`` keyed by MCP tool name (a key may be the MCP name or the prefixed dex name);
    a key that names no tool of the server is refused."""
    names = {spec.name for spec in listed}
    chosen: dict[str, ToolPolicy] = {}
    for key, policy in given.items():
        if key in names:
            name = key
        elif prefix and key.startswith(prefix) and key[len(prefix):] in names:
            name = key[len(prefix):]
        else:
            raise ToolDefinitionError(
                f"mcp_tools: policies names {key!r}, which is not a tool of {label} "
                f"(its tools: {', '.join(sorted(names)) or 'none'})"
            )
        if name in chosen:
            raise ToolDefinitionError(f"mcp_tools: policies gives tool {name!r} twice "
                                      f"(as {name!r} and as {prefix + name!r})")
        chosen[name] = policy
    return chosen


def _define(target: ServerConnection, name: str, spec: MCPTool,
            policy: ToolPolicy | None) -> Tool[Any]:
    hints = None
    if spec.annotations is not None:
        dumped = spec.annotations.model_dump(by_alias=True, exclude_none=True)
        hints = {k: dumped[k] for k in _HINT_KEYS if k in dumped} or None
    explicit: dict[str, Any] = {}
    if policy is not None:
        explicit = {
            "effect": policy.effect,
            "requires_approval": policy.requires_approval,
            "max_attempts": policy.max_attempts,
            "time_limit": policy.time_limit,
            "approval_deadline": policy.approval_deadline,
        }
    return define_tool(
        name,
        spec.input_schema,
        _runner(target, spec.name),
        description=spec.description or spec.title or "",
        hints=hints,
        **explicit,
    )


def _runner(target: ServerConnection,
            mcp_name: str) -> Callable[[ToolContext, dict[str, Any]], Any]:
    def run(ctx: ToolContext, arguments: dict[str, Any]) -> Any:
        return _result_value(target.call(mcp_name, arguments, ctx.idempotency_key))

    run.__name__ = f"mcp_{mcp_name}"
    return run
