"""The tool catalog: what workers publish so agent processes need not import tool code."""

from __future__ import annotations

import difflib
import functools
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from pydantic_core import SchemaValidator
from sqlalchemy.exc import IntegrityError

from dex_tasks.arguments import normalize_with, validator_for
from dex_tasks.errors import UnknownToolError
from dex_tasks.policy import EffectClass, ToolPolicy, resolve_policy
from dex_tasks.registry import (
    Tool,
    get_local_tool,
    local_tools,
    schema_validator,
    validate_against_schema,
)
from dex_tasks.settings import sqlite_file
from dex_tasks.store import Store


@dataclass(frozen=True)  # not slots: the validator is cached on the instance
class ToolInfo:
    """What a caller needs to know of a tool: its explicit policy (if any), hints, schema."""

    name: str
    policy: ToolPolicy | None
    hints: dict[str, Any] | None
    schema: dict[str, Any]
    local: Tool[Any] | None = None

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments as the tool will run with them (JSON form): validated against the
        tool's local code, else against its published schema as the worker's pydantic
        validation would (``dex_tasks.arguments``), coerced and with defaults filled in.

        Raises ``registry.InvalidArguments`` naming every field that is wrong, with its value.
        """
        if self.local is not None:
            return self.local.normalize(arguments)
        normalized = normalize_with(self.name, self._normalizer, arguments)
        return validate_against_schema(self.name, self._validator, normalized)

    @functools.cached_property
    def _validator(self) -> Draft202012Validator:
        return schema_validator(self.schema)

    @functools.cached_property
    def _normalizer(self) -> SchemaValidator:
        return validator_for(self.schema)


@dataclass(frozen=True)
class ToolSpec:
    """A tool as a framework adapter (or a model) needs to know it, from ``list_tools()``.

    ``policy`` is the policy a call made now would get (explicit policy > the tool's MCP hints
    > the session default given to ``list_tools`` > ``unclassified``); ``policy.needs_approval``
    says whether its calls wait for a person. ``parameters`` is the JSON schema of its
    arguments and ``description`` the tool's docstring.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    policy: ToolPolicy
    hints: dict[str, Any] | None = None


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


def store_location(store: Store) -> str:
    """The store's URL (no password) and, for SQLite, the file it resolves to: a relative
    path is relative to each process's own folder, the usual reason an agent finds no tools."""
    where = store.safe_url
    file = sqlite_file(store.url)
    if file is not None:
        relative = "" if store.url.partition(":///")[2].startswith("/") else \
            ", relative to this process's folder"
        where += f" (the file {file}{relative})"
    return where


def lookup(store: Store, name: str) -> ToolInfo:
    """Find a tool in this process's registry, else in the published catalog."""
    local = get_local_tool(name)
    if local is not None:
        return ToolInfo(name, local.explicit_policy, local.hints, local.schema, local)
    row = store.get_catalog(name)
    if row is None:
        published = [r.name for r in store.list_catalog()]  # read only on this error path
        close = difflib.get_close_matches(name, sorted({*published, *local_tools()}), n=3)
        raise UnknownToolError(name, empty_catalog_at=None if published else store_location(store),
                               suggestions=close)
    raw_policy = json.loads(row.policy)
    return ToolInfo(
        name=name,
        policy=ToolPolicy.from_json(raw_policy) if raw_policy else None,
        hints=json.loads(row.hints) if row.hints else None,
        schema=json.loads(row.arguments_schema),
    )


def list_specs(
    store: Store, default_effect: EffectClass | str | None = None
) -> list[ToolSpec]:
    """Every tool of the published catalog, and of this process's registry (which wins for a
    name in both), sorted by name."""
    infos: dict[str, tuple[ToolPolicy | None, dict[str, Any] | None, dict[str, Any], str]] = {}
    for row in store.list_catalog():
        raw_policy = json.loads(row.policy)
        infos[row.name] = (
            ToolPolicy.from_json(raw_policy) if raw_policy else None,
            json.loads(row.hints) if row.hints else None,
            json.loads(row.arguments_schema),
            row.description or "",
        )
    for name, tool in local_tools().items():
        infos[name] = (tool.explicit_policy, tool.hints, tool.schema, tool.description or "")
    return [
        ToolSpec(name=name, description=description, parameters=schema,
                 policy=resolve_policy(policy, hints, default_effect), hints=hints)
        for name, (policy, hints, schema, description) in sorted(infos.items())
    ]
