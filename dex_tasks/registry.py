"""The ``@tool`` decorator, the context a tool receives, and the local registry of tools."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, ParamSpec, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from dex_tasks.errors import ToolDefinitionError
from dex_tasks.policy import EffectClass, ToolPolicy, parse_effect

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class ToolContext:
    """What a tool knows about the call it is running.

    Pass ``idempotency_key`` to the service the tool writes to: it is the same for every attempt
    of the call, so the service can drop duplicates.
    """

    idempotency_key: str
    session_id: str
    turn_id: str
    tool_call_id: str
    attempt: int


class InvalidArguments(ValueError):
    """The arguments do not match the tool's signature; the message names the fields."""


def _format_validation_error(tool: str, err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        field = ".".join(str(x) for x in item["loc"]) or "(arguments)"
        parts.append(f"{field}: {item['msg']}")
    return f"invalid arguments for tool {tool!r}: " + "; ".join(parts)


class Tool(Generic[R]):
    """A function registered with ``@tool``: callable as before, plus its policy and schema."""

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        name: str,
        policy: ToolPolicy | None,
        hints: Mapping[str, Any] | None,
    ) -> None:
        self.fn = fn
        self.name = name
        self.explicit_policy = policy
        self.hints = dict(hints) if hints else None
        self.description = inspect.getdoc(fn)
        self.arguments_model = _arguments_model(fn, name)
        self.reconcile_fn: Callable[[str, dict[str, Any]], str | None] | None = None
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", name)
        self.__wrapped__ = fn

    def __call__(self, ctx: ToolContext, /, **arguments: Any) -> R:
        return self.fn(ctx, **arguments)

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema of the tool's keyword arguments."""
        return self.arguments_model.model_json_schema()

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check arguments against the signature; return them coerced to the declared types.

        Raises :class:`InvalidArguments` naming every field that is wrong.
        """
        try:
            model = self.arguments_model.model_validate(dict(arguments))
        except ValidationError as err:
            raise InvalidArguments(_format_validation_error(self.name, err)) from None
        return {name: getattr(model, name) for name in type(model).model_fields}

    def reconciler(
        self, fn: Callable[[str, dict[str, Any]], str | None]
    ) -> Callable[[str, dict[str, Any]], str | None]:
        """Register ``fn(idempotency_key, arguments) -> report or None`` as this tool's checker.

        It is asked what really happened to calls that ended ``outcome_unknown``.
        """
        self.reconcile_fn = fn
        return fn


def _arguments_model(fn: Callable[..., Any], tool_name: str) -> type[BaseModel]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise ToolDefinitionError(f"tool {tool_name!r}: cannot read its signature: {err}") from err
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise ToolDefinitionError(
            f"tool {tool_name!r}: its first parameter must take the ToolContext"
        )
    fields: dict[str, Any] = {}
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception as err:
        raise ToolDefinitionError(f"tool {tool_name!r}: cannot resolve annotations: {err}") from err
    for param in params[1:]:
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise ToolDefinitionError(
                f"tool {tool_name!r}: *args/**kwargs parameter {param.name!r} has no schema"
            )
        annotation = hints.get(param.name, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (annotation, default)
    model_name = "".join(part.capitalize() for part in tool_name.replace(".", "_").split("_"))
    return create_model(  # type: ignore[call-overload,no-any-return]
        f"{model_name}Arguments",
        __config__=ConfigDict(extra="forbid"),
        **fields,
    )


_REGISTRY: dict[str, Tool[Any]] = {}


def tool(
    fn: Callable[..., R] | None = None,
    *,
    effect: EffectClass | str | None = None,
    requires_approval: bool | None = None,
    name: str | None = None,
    max_attempts: int | None = None,
    time_limit: float | timedelta | None = None,
    approval_deadline: float | timedelta | None = None,
    hints: Mapping[str, Any] | None = None,
) -> Any:
    """Register a function as a tool.

    ``effect`` (an :class:`EffectClass` or its name) makes the policy explicit. Without it the
    policy is derived when a call is made: from ``hints`` (MCP annotations ``readOnlyHint``,
    ``idempotentHint``, ``destructiveHint``), then from the session's default effect, else
    ``unclassified``. The function takes a :class:`ToolContext` first, then keyword arguments.
    """

    def decorate(func: Callable[..., R]) -> Tool[R]:
        tool_name = name or func.__name__
        explicit: ToolPolicy | None = None
        tuning = (requires_approval, max_attempts, time_limit, approval_deadline)
        if effect is not None:
            explicit = ToolPolicy(
                effect=parse_effect(effect),
                requires_approval=requires_approval,
                max_attempts=max_attempts,
                time_limit=time_limit,  # type: ignore[arg-type]
                approval_deadline=approval_deadline,  # type: ignore[arg-type]
            )
        elif any(v is not None for v in tuning):
            raise ToolDefinitionError(
                f"tool {tool_name!r}: requires_approval, max_attempts, time_limit and "
                "approval_deadline are part of an explicit policy; give effect= too"
            )
        registered = Tool(func, name=tool_name, policy=explicit, hints=hints)
        _REGISTRY[tool_name] = registered
        return registered

    if fn is not None:
        return decorate(fn)
    return decorate


def get_local_tool(name: str) -> Tool[Any] | None:
    """The tool registered under ``name`` in this process, if any."""
    return _REGISTRY.get(name)


def local_tools() -> dict[str, Tool[Any]]:
    """A copy of this process's registry."""
    return dict(_REGISTRY)


def json_problem(value: Any, path: str = "arguments") -> str | None:
    """What keeps ``value`` from being plain JSON, naming where; None when it is JSON.

    ``json.dumps`` would turn a ``date`` into nothing, or with ``default=str`` into a string
    equal to another call's string, turn ``{1: ...}`` into ``{"1": ...}``, and write ``NaN``,
    which other JSON readers refuse or read as null. A call's arguments are its identity, so
    anything that does not survive a round trip unchanged is refused instead.
    """
    if value is None or isinstance(value, bool | str):
        return None
    if isinstance(value, int):
        return None
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return f"{path} is {value!r}, which JSON cannot represent"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path} has a key {k!r} of type {type(k).__name__}; JSON keys are strings"
            problem = json_problem(v, f"{path}.{k}")
            if problem:
                return problem
        return None
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            problem = json_problem(v, f"{path}[{i}]")
            if problem:
                return problem
        return None
    return (f"{path} is a {type(value).__name__}, not a JSON value (str, number, bool, null, "
            "list or object); convert it first")


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no spaces, so equal arguments give equal text.

    Refuses (``ValueError``, naming where) anything :func:`json_problem` finds.
    """
    problem = json_problem(value)
    if problem:
        raise ValueError(problem)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
