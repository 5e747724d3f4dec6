"""The ``@tool`` decorator, the context a tool receives, and the local registry of tools."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import SchemaValidator

from dex_tasks.arguments import InvalidArguments as InvalidArguments
from dex_tasks.arguments import (
    json_form,
    normalize_with,
    pattern_matches,
    shown_value,
    validator_for,
)
from dex_tasks.errors import ToolDefinitionError
from dex_tasks.limits import TOOL_NAME_MAX, check_id, text_problem
from dex_tasks.policy import EffectClass, ToolPolicy, parse_effect
from dex_tasks.rules import ApprovalRule

Approval = bool | ApprovalRule | Mapping[str, Any] | None
"""What ``requires_approval`` takes: a flag, a rule on the arguments (``rules.when``), its JSON."""

if TYPE_CHECKING:
    # jsonschema costs a third of a second to import, and only tools defined from a JSON
    # schema (define_tool, MCP) use it: it is imported where they are built.
    from jsonschema import Draft202012Validator

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


def _format_validation_error(tool: str, err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        field = ".".join(str(x) for x in item["loc"]) or "(arguments)"
        value = "" if item["type"] == "missing" else f" (got {shown_value(item['input'])})"
        parts.append(f"{field}: {item['msg']}{value}")
    return f"invalid arguments for tool {tool!r}: " + "; ".join(parts)


class Tool(Generic[R]):
    """A registered tool: callable as before, plus its policy, schema and description.

    Made by ``@tool`` from a Python function, whose signature gives the argument schema, or by
    :func:`define_tool` from a name, a JSON schema and a function (for proxies whose tools are
    only known at run time, such as an MCP server's).
    """

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        name: str,
        policy: ToolPolicy | None,
        hints: Mapping[str, Any] | None,
        parameters: Mapping[str, Any] | None = None,
        description: str | None = None,
    ) -> None:
        check_id("tool name", name, TOOL_NAME_MAX, error=ToolDefinitionError)
        self.fn = fn
        self.name = name
        self.explicit_policy = policy
        self.hints = dict(hints) if hints else None
        self.description = description if description is not None else inspect.getdoc(fn)
        self.arguments_model: type[BaseModel] | None = None
        self._validator: Draft202012Validator | None = None
        if parameters is None:
            self.arguments_model = _arguments_model(fn, name)
            self._schema = self.arguments_model.model_json_schema()
        else:
            self._schema = _checked_schema(name, parameters)
            self._validator = schema_validator(self._schema)
        self.reconcile_fn: Callable[[str, dict[str, Any]], str | None] | None = None
        self.__doc__ = self.description
        self.__name__ = getattr(fn, "__name__", name)
        self.__wrapped__ = fn

    def __call__(self, ctx: ToolContext, /, **arguments: Any) -> R:
        if self._validator is not None:
            # A schema tool's argument names are the schema's, not Python identifiers: it
            # takes them as one dict.
            return self.fn(ctx, dict(arguments))
        return self.fn(ctx, **arguments)

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema of the tool's arguments (an object schema)."""
        return self._schema

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check arguments against the schema; return them (coerced to the declared types for
        a signature-made tool).

        Raises :class:`InvalidArguments` naming every field that is wrong.
        """
        if self._validator is not None:
            return validate_against_schema(self.name, self._validator, arguments)
        model = self._model(arguments)
        return {name: getattr(model, name) for name in type(model).model_fields}

    def _model(self, arguments: Mapping[str, Any]) -> BaseModel:
        """A signature-made tool's validated arguments; :class:`InvalidArguments` if wrong."""
        assert self.arguments_model is not None
        try:
            return self.arguments_model.model_validate(dict(arguments))
        except ValidationError as err:
            raise InvalidArguments(_format_validation_error(self.name, err)) from None

    def normalize(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments as the tool will run with them, in their JSON form: validated,
        coerced and with defaults filled in (what a call records and its rule judges).

        Raises :class:`InvalidArguments` naming every field that is wrong, with its value.
        """
        if self._validator is not None:
            normalized = normalize_with(self.name, self._normalizer, arguments)
            return validate_against_schema(self.name, self._validator, normalized)
        model = self._model(arguments)
        return json_form(self.name, model.model_dump(mode="json"))

    @functools.cached_property
    def _normalizer(self) -> SchemaValidator:
        # A schema tool's (built on first use: an MCP server may bring hundreds of tools).
        return validator_for(self._schema)

    def recorded_arguments(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The validated arguments of a recorded call, which the tool runs with.

        The call recorded its arguments normalized (``normalize``), and its approval rule
        judged those: a validation here that would change them (a schema the agent process
        read differently, a default the published schema does not show) would run the tool on
        values no one judged, so it raises :class:`InvalidArguments` naming the fields instead.
        """
        recorded = dict(arguments)
        normalized = self.normalize(recorded)
        if canonical_json(normalized) != canonical_json(recorded):
            changed = sorted(k for k in set(normalized) | set(recorded)
                             if k not in normalized or k not in recorded
                             or canonical_json(normalized[k]) != canonical_json(recorded[k]))
            raise InvalidArguments(
                f"invalid arguments for tool {self.name!r}: this worker's validation would "
                f"change {', '.join(changed)} from the recorded value that the call's approval "
                "rule judged; refused rather than run on other values")
        return self.validate(recorded)

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
    requires_approval: Approval = None,
    name: str | None = None,
    max_attempts: int | None = None,
    time_limit: float | timedelta | None = None,
    approval_deadline: float | timedelta | None = None,
    hints: Mapping[str, Any] | None = None,
    approvals: int = 1,
    approver_permission: str | None = None,
    webhooks: tuple[str, ...] | list[str] = (),
    allow_self_approval: bool = False,
) -> Any:
    """Register a function as a tool.

    ``effect`` (an :class:`EffectClass` or its name) makes the policy explicit. Without it the
    policy is derived when a call is made: from ``hints`` (MCP annotations ``readOnlyHint``,
    ``idempotentHint``, ``destructiveHint``), then from the session's default effect, else
    ``unclassified``. The function takes a :class:`ToolContext` first, then keyword arguments.
    ``requires_approval`` may be a rule on the arguments (``dex_tasks.rules.when``);
    ``approvals``, ``approver_permission``, ``webhooks`` and ``allow_self_approval`` are
    :class:`ToolPolicy`'s.
    """

    def decorate(func: Callable[..., R]) -> Tool[R]:
        tool_name = name or func.__name__
        explicit = _explicit_policy(tool_name, effect, requires_approval, max_attempts,
                                    time_limit, approval_deadline,
                                    approvals=approvals, approver_permission=approver_permission,
                                    webhooks=tuple(webhooks),
                                    allow_self_approval=allow_self_approval)
        registered = Tool(func, name=tool_name, policy=explicit, hints=hints)
        _REGISTRY[tool_name] = registered
        return registered

    if fn is not None:
        return decorate(fn)
    return decorate


def define_tool(
    name: str,
    parameters: Mapping[str, Any],
    fn: Callable[[ToolContext, dict[str, Any]], R],
    *,
    description: str | None = None,
    effect: EffectClass | str | None = None,
    requires_approval: Approval = None,
    max_attempts: int | None = None,
    time_limit: float | timedelta | None = None,
    approval_deadline: float | timedelta | None = None,
    hints: Mapping[str, Any] | None = None,
) -> Tool[R]:
    """Register a tool known only at run time: a name, a JSON schema and a function.

    ``parameters`` is the JSON schema of the arguments (an object schema, draft 2020-12);
    calls are validated against it. ``fn(ctx, arguments)`` receives the :class:`ToolContext`
    and the arguments as one dict. The policy arguments are those of :func:`tool`; ``hints``
    are MCP tool annotations, used only when no ``effect`` is given.
    """
    explicit = _explicit_policy(name, effect, requires_approval, max_attempts, time_limit,
                                approval_deadline)
    registered = Tool(fn, name=name, policy=explicit, hints=hints, parameters=parameters,
                      description=description)
    _REGISTRY[name] = registered
    return registered


def _explicit_policy(
    tool_name: str,
    effect: EffectClass | str | None,
    requires_approval: Approval,
    max_attempts: int | None,
    time_limit: float | timedelta | None,
    approval_deadline: float | timedelta | None,
    *,
    approvals: int = 1,
    approver_permission: str | None = None,
    webhooks: tuple[str, ...] = (),
    allow_self_approval: bool = False,
) -> ToolPolicy | None:
    if effect is not None:
        return ToolPolicy(
            effect=parse_effect(effect),
            requires_approval=requires_approval,  # type: ignore[arg-type]  # checked there
            max_attempts=max_attempts,
            time_limit=time_limit,  # type: ignore[arg-type]
            approval_deadline=approval_deadline,  # type: ignore[arg-type]
            approvals=approvals,
            approver_permission=approver_permission,
            webhooks=webhooks,
            allow_self_approval=allow_self_approval,
        )
    if any(v is not None for v in (requires_approval, max_attempts, time_limit,
                                   approval_deadline, approver_permission)) \
            or approvals != 1 or webhooks or allow_self_approval:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: requires_approval, max_attempts, time_limit and "
            "approval_deadline are part of an explicit policy; give effect= too"
        )
    return None


def _checked_schema(tool_name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    schema = dict(parameters)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as err:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: its parameters are not a valid JSON schema: {err.message}"
        ) from None
    if schema.get("type", "object") != "object":
        raise ToolDefinitionError(
            f"tool {tool_name!r}: its parameters schema must describe an object, "
            f"got type {schema.get('type')!r}"
        )
    return schema


def schema_validator(schema: Mapping[str, Any]) -> Draft202012Validator:
    """A validator for a tool's published argument schema.

    Its ``pattern`` and ``patternProperties`` run in linear time (``arguments.pattern_matches``)
    rather than on Python's backtracking ``re``: a third-party schema's pattern must not let
    model input hang the process.
    """
    validator: Draft202012Validator = _safe_validator_class()(dict(schema))
    return validator


@functools.cache
def _safe_validator_class() -> Any:
    from jsonschema import Draft202012Validator, ValidationError, validators

    def pattern(validator: Any, patrn: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if validator.is_type(instance, "string") and isinstance(patrn, str) \
                and pattern_matches(patrn, instance) is False:
            yield ValidationError(f"{shown_value(instance)} does not match {patrn!r}")

    def pattern_properties(validator: Any, patterns: Any, instance: Any,
                           schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for k, v in instance.items():
                if pattern_matches(patrn, k):
                    yield from validator.descend(v, subschema, path=k, schema_path=patrn)

    def additional_properties(validator: Any, extra: Any, instance: Any,
                              schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        known = schema.get("properties", {})
        patterns = list(schema.get("patternProperties", {}))
        extras = sorted(k for k in instance if k not in known
                        and not any(pattern_matches(p, k) for p in patterns))
        if validator.is_type(extra, "object"):
            for k in extras:
                yield from validator.descend(instance[k], extra, path=k)
        elif extra is False and extras:
            yield ValidationError("Additional properties are not allowed ("
                                  + ", ".join(repr(k) for k in extras) + " unexpected)")

    return validators.extend(Draft202012Validator, {  # type: ignore[no-untyped-call]
        "pattern": pattern, "patternProperties": pattern_properties,
        "additionalProperties": additional_properties})


def validate_against_schema(
    tool_name: str, validator: Draft202012Validator, arguments: Mapping[str, Any]
) -> dict[str, Any]:
    """``arguments`` if they satisfy the schema; else :class:`InvalidArguments` naming every
    field that is wrong."""
    errors = sorted(validator.iter_errors(dict(arguments)), key=lambda e: list(e.path))
    if errors:
        parts = [f"{'.'.join(str(p) for p in e.path) or '(arguments)'}: {e.message}"
                 for e in errors]
        raise InvalidArguments(f"invalid arguments for tool {tool_name!r}: " + "; ".join(parts))
    return dict(arguments)


def get_local_tool(name: str) -> Tool[Any] | None:
    """The tool registered under ``name`` in this process, if any."""
    return _REGISTRY.get(name)


def local_tools() -> dict[str, Tool[Any]]:
    """A copy of this process's registry."""
    return dict(_REGISTRY)


def _nodes(value: Any, path: str) -> Iterator[tuple[Any, str, bool]]:
    """Every value inside ``value`` (itself first) and every object key, as ``(node, path,
    is_key)``, depth first. A loop with its own stack, not recursion, so a value nested
    deeper than Python's recursion limit is walked like any other."""
    stack: list[tuple[Any, str, bool]] = [(value, path, False)]
    while stack:
        node, where, is_key = stack.pop()
        yield node, where, is_key
        if is_key:
            continue
        if isinstance(node, dict):
            for k, v in reversed(list(node.items())):
                stack.append((v, f"{where}.{k}", False))
                stack.append((k, f"a key of {where}", True))
        elif isinstance(node, list | tuple):
            stack.extend((v, f"{where}[{i}]", False) for i, v in reversed(list(enumerate(node))))


def json_problem(value: Any, path: str = "arguments") -> str | None:
    """What keeps ``value`` from being plain JSON, naming where; None when it is JSON.

    ``json.dumps`` would turn a ``date`` into nothing, or with ``default=str`` into a string
    equal to another call's string, turn ``{1: ...}`` into ``{"1": ...}``, and write ``NaN``,
    which other JSON readers refuse or read as null. A call's arguments are its identity, so
    anything that does not survive a round trip unchanged is refused instead.
    """
    if _plainly_json(value):
        return None
    for node, where, is_key in _nodes(value, path):
        if is_key and not isinstance(node, str):
            owner = where.removeprefix("a key of ")
            return (f"{owner} has a key {node!r} of type {type(node).__name__}; "
                    "JSON keys are strings")
        if isinstance(node, str):
            problem = string_problem(node, where)
        elif node is None or isinstance(node, bool | int | dict | list | tuple):
            problem = None
        elif isinstance(node, float):
            problem = (f"{where} is {node!r}, which JSON cannot represent"
                       if node != node or node in (float("inf"), float("-inf")) else None)
        else:
            problem = (f"{where} is a {type(node).__name__}, not a JSON value (str, number, "
                       "bool, null, list or object); convert it first")
        if problem:
            return problem
    return None


def _plainly_json(value: Any) -> bool:
    """True when ``value`` is made of the plain JSON types alone (``dict``, ``list``,
    ``tuple``, ``str``, ``int``, ``bool``, finite ``float``, ``None``; string keys) and holds
    no string the store cannot hold: then :func:`json_problem` finds nothing.

    Every call's arguments pass here twice (as sent and normalized): this walk builds no
    path and yields nothing, a third or less of the cost of the walk that names where (1.6-3
    against 10 µs for five fields, nested ones included).
    False means "not sure" (a subclass, a problem): the walk that names where decides.
    """
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is str:
            # isascii is a flag on the string object: only other text is encoded.
            if "\x00" in node or (not node.isascii() and text_problem(node)):
                return False
        elif kind is dict:
            for key, item in node.items():
                if type(key) is not str or "\x00" in key or (
                        not key.isascii() and text_problem(key)):
                    return False
                stack.append(item)
        elif kind is list or kind is tuple:
            stack.extend(node)
        elif kind is float:
            if node != node or node in (_INF, -_INF):
                return False
        elif not (node is None or kind is int or kind is bool):
            return False
    return True


_INF = float("inf")


def string_problem(text: str, path: str) -> str | None:
    """Why the store cannot hold ``text`` inside JSON (a NUL, a lone surrogate); None if it can.

    PostgreSQL's jsonb refuses both, even escaped (``\\u0000``); they are refused on SQLite too,
    so a value behaves the same whichever store it lands in.
    """
    problem = text_problem(text)
    return f"{path} {problem}" if problem else None


def strings_problem(value: Any, path: str) -> str | None:
    """:func:`string_problem` of every string (and object key) inside ``value``."""
    for node, where, _ in _nodes(value, path):
        problem = string_problem(node, where) if isinstance(node, str) else None
        if problem:
            return problem
    return None


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no spaces, so equal arguments give equal text.

    Refuses (``ValueError``, naming where) anything :func:`json_problem` finds.
    """
    problem = json_problem(value)
    if problem:
        raise ValueError(problem)
    return _CANONICAL.encode(value)


# What json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False) writes, with
# its encoder made once: json.dumps makes one per call when given options. (An encoder keeps
# no state between calls: one serves every thread.)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)
