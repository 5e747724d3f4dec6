"""The tool catalog: what workers publish so agent processes need not import tool code."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError

from dex_tasks.errors import UnknownToolError
from dex_tasks.policy import ToolPolicy
from dex_tasks.registry import Tool, get_local_tool
from dex_tasks.store import Store


@dataclass(frozen=True)
class ToolInfo:
    """What a caller needs to know of a tool: its explicit policy (if any), hints, schema."""

    name: str
    policy: ToolPolicy | None
    hints: dict[str, Any] | None
    schema: dict[str, Any]
    local: Tool[Any] | None = None


def entry_for(tool: Tool[Any], now: float) -> dict[str, Any]:
    """The catalog row of one local tool."""
    return {
        "name": tool.name,
        "policy": json.dumps(tool.explicit_policy.to_json() if tool.explicit_policy else None),
        "hints": json.dumps(tool.hints) if tool.hints else None,
        "arguments_schema": json.dumps(tool.schema),
        "description": tool.description,
        "updated_at": now,
    }


def publish(store: Store, tools: Iterable[Tool[Any]]) -> int:
    """Upsert the catalog entries of ``tools``; returns how many."""
    entries = [entry_for(t, time.time()) for t in tools]
    try:
        return store.publish_catalog(entries)
    except IntegrityError:
        # Two workers inserted the same new tool at once; the second pass updates.
        return store.publish_catalog(entries)


def lookup(store: Store, name: str) -> ToolInfo:
    """Find a tool in this process's registry, else in the published catalog."""
    local = get_local_tool(name)
    if local is not None:
        return ToolInfo(name, local.explicit_policy, local.hints, local.schema, local)
    row = store.get_catalog(name)
    if row is None:
        raise UnknownToolError(name)
    raw_policy = json.loads(row.policy)
    return ToolInfo(
        name=name,
        policy=ToolPolicy.from_json(raw_policy) if raw_policy else None,
        hints=json.loads(row.hints) if row.hints else None,
        schema=json.loads(row.arguments_schema),
    )
