"""A call's arguments as the tool will run with them, worked out from the published JSON schema.

The agent process that calls ``call_tool`` has no tool code, only the JSON schema of each
tool's arguments that the workers published. The worker runs a ``@tool`` function on what
pydantic's validation of its signature produces, in pydantic's lax mode: ``"true"`` becomes
``True``, ``"5"`` becomes ``5``, an argument left out gets its default. An approval rule judged
on the model's raw JSON would judge other values than the tool runs with (a refund whose
``amount_cents`` defaults to 50,000 slips past ``amount_cents > 10_000``).

:func:`normalize` therefore validates arguments against the published schema the way pydantic
validates them on the worker, by building a validator of pydantic's own core (``pydantic_core``)
from the schema: the same lax coercions, defaults filled in, the same refusals. What it returns
is the JSON form of the validated arguments, which is what the call records, what the rule
judges and what the worker receives. The worker checks that its own validation leaves the
recorded arguments as they are (``registry.Tool.recorded_arguments``), so the two can never
diverge silently: a schema feature this module does not mirror makes the call refused, not run
on other values.

Mirrored: ``type`` (string, integer, number, boolean, null, array, object, and lists of
types), ``enum``/``const``, ``anyOf``/``oneOf`` (pydantic's smart union), a one-item
``allOf``, local ``$ref`` into ``$defs`` (recursive models included), ``properties`` with
``required`` and ``default``, ``additionalProperties`` (false, true or a schema),
``prefixItems``, the numeric and length bounds, ``pattern`` and the ``date-time``, ``date``,
``time``, ``uuid`` and ``duration`` formats. Other keywords are left to the JSON-schema check
that follows (``registry.schema_validator``).

``pattern`` runs on pydantic-core's Rust regex engine, which matches in time linear in the
input: a third-party schema's pattern cannot make the agent or the worker backtrack for ever
on model input. A pattern that engine cannot compile (a backreference, a lookaround: the
constructs that need backtracking) is not evaluated here nor by the JSON-schema check; the
tool's own server still checks it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from pydantic_core import (
    CoreSchema,
    SchemaError,
    SchemaValidator,
    ValidationError,
    to_jsonable_python,
)
from pydantic_core import core_schema as cs

from dex_tasks.errors import DexError

__all__ = ["InvalidArguments", "arguments_version", "json_form", "normalize", "normalize_with",
           "pattern_matches", "shown_value", "validator_for"]


class InvalidArguments(DexError, ValueError):
    """The arguments do not match the tool's schema or signature; the message names each field
    that is wrong, with its value. Nothing was recorded or run."""


_FORMATS: dict[str, Callable[[], CoreSchema]] = {
    "date-time": cs.datetime_schema, "date": cs.date_schema, "time": cs.time_schema,
    "uuid": cs.uuid_schema, "duration": cs.timedelta_schema,
}
_VALUE_SHOWN_MAX = 60


def arguments_version(arguments: Mapping[str, Any]) -> str:
    """The id of one version of a call's arguments: a digest of their canonical JSON.

    An approval names the version it approves (``resolve_interrupt(arguments_version=...)``,
    the page sends the one it shows): a version edited meanwhile by another approver is not
    approved by someone who saw the earlier one."""
    text = json.dumps(dict(arguments), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shown_value(value: Any) -> str:
    """A value as an error message shows it: JSON, cut to a readable length."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _VALUE_SHOWN_MAX else text[:_VALUE_SHOWN_MAX - 3] + "..."


@functools.lru_cache(maxsize=1024)
def _pattern_validator(pattern: str) -> SchemaValidator | None:
    try:
        return SchemaValidator(cs.str_schema(pattern=pattern))
    except SchemaError:
        return None  # not compilable by the linear-time engine: not evaluated


def pattern_matches(pattern: str, text: str) -> bool | None:
    """Whether ``pattern`` is found in ``text`` (JSON schema's unanchored search), in time
    linear in ``text``; None when the pattern needs backtracking (a backreference, a
    lookaround), which is not evaluated."""
    validator = _pattern_validator(pattern)
    if validator is None:
        return None
    try:
        validator.validate_python(text, strict=True)
    except ValidationError:
        return False
    return True


class _Translator:
    """A JSON schema (the subset tools publish) as a pydantic-core schema."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.refs: dict[str, CoreSchema] = {}

    def ref(self, ref: str) -> CoreSchema:
        prefix = "#/$defs/"
        if not ref.startswith(prefix) or "/" in ref[len(prefix):]:
            return cs.any_schema()  # a remote or deep reference: left to the JSON-schema check
        name = ref[len(prefix):]
        if name not in self.refs:
            target = (self.root.get("$defs") or {}).get(name)
            self.refs[name] = cs.any_schema()  # a placeholder while a recursive one is built
            schema = self.node(target) if isinstance(target, Mapping) else cs.any_schema()
            self.refs[name] = {**schema, "ref": name}  # type: ignore[typeddict-item]
        return cs.definition_reference_schema(name)

    def node(self, node: Any) -> CoreSchema:
        if not isinstance(node, Mapping):
            return cs.any_schema()  # true, or not a schema: anything
        if "$ref" in node:
            return self.ref(str(node["$ref"]))
        if "const" in node:
            return cs.literal_schema([node["const"]])
        if isinstance(node.get("enum"), list) and node["enum"]:
            return cs.literal_schema(list(node["enum"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key]:
                return self.union([self.node(item) for item in node[key]])
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            return self.node(node["allOf"][0])
        kind = node.get("type")
        if kind is None and ("properties" in node or "additionalProperties" in node):
            kind = "object"
        if isinstance(kind, list):
            return self.union([self.node({**node, "type": k}) for k in kind])
        return self.typed(kind, node)

    def union(self, choices: list[CoreSchema]) -> CoreSchema:
        if len(choices) == 1:
            return choices[0]
        others = [c for c in choices if c.get("type") != "none"]
        if len(others) == len(choices):
            return cs.union_schema(choices)  # type: ignore[arg-type]
        inner = others[0] if len(others) == 1 else cs.union_schema(others)  # type: ignore[arg-type]
        return cs.nullable_schema(inner)

    def typed(self, kind: Any, node: Mapping[str, Any]) -> CoreSchema:
        bounds = {"ge": node.get("minimum"), "le": node.get("maximum"),
                  "gt": node.get("exclusiveMinimum"), "lt": node.get("exclusiveMaximum"),
                  "multiple_of": node.get("multipleOf")}
        bounds = {k: v for k, v in bounds.items()
                  if isinstance(v, int | float) and not isinstance(v, bool)}
        if kind == "string":
            fmt = _FORMATS.get(str(node.get("format")))
            if fmt is not None:
                return fmt()
            pattern = node.get("pattern")
            if isinstance(pattern, str) and _pattern_validator(pattern) is None:
                pattern = None
            return cs.str_schema(min_length=node.get("minLength"),
                                 max_length=node.get("maxLength"),
                                 pattern=pattern if isinstance(pattern, str) else None)
        if kind == "integer":
            return cs.int_schema(**bounds)
        if kind == "number":
            return cs.float_schema(**bounds)
        if kind == "boolean":
            return cs.bool_schema()
        if kind == "null":
            return cs.none_schema()
        if kind == "array":
            return self.array(node)
        if kind == "object":
            return self.object(node)
        return cs.any_schema()

    def array(self, node: Mapping[str, Any]) -> CoreSchema:
        lengths = {"min_length": node.get("minItems"), "max_length": node.get("maxItems")}
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            rest = node.get("items")
            return cs.tuple_schema(
                [self.node(item) for item in prefix]
                + ([self.node(rest)] if isinstance(rest, Mapping) else []),
                variadic_item_index=len(prefix) if isinstance(rest, Mapping) else None,
                **lengths)
        return cs.list_schema(self.node(node.get("items", True)), **lengths)

    def object(self, node: Mapping[str, Any]) -> CoreSchema:
        properties = node.get("properties") or {}
        required = set(node.get("required") or ())
        extra = node.get("additionalProperties", True)
        if not properties and isinstance(extra, Mapping):
            return cs.dict_schema(cs.str_schema(), self.node(extra))
        fields: dict[str, cs.TypedDictField] = {}
        for name, prop in properties.items():
            inner = self.node(prop)
            if isinstance(prop, Mapping) and "default" in prop and name not in required:
                # As pydantic does: the default is filled in as it is, not validated.
                inner = cs.with_default_schema(inner, default=prop["default"])
                fields[name] = cs.typed_dict_field(inner)
            else:
                fields[name] = cs.typed_dict_field(inner, required=name in required)
        return cs.typed_dict_schema(
            fields,
            extra_behavior="forbid" if extra is False else "allow",
            extras_schema=self.node(extra) if isinstance(extra, Mapping) else None)


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> SchemaValidator:
    schema = json.loads(schema_json)
    translator = _Translator(schema)
    core = translator.node(schema)
    if translator.refs:
        core = cs.definitions_schema(core, list(translator.refs.values()))
    return SchemaValidator(core)


def normalize(tool: str, schema: Mapping[str, Any], arguments: Mapping[str, Any]
              ) -> dict[str, Any]:
    """``arguments`` validated against the tool's published ``schema`` as pydantic's lax mode
    validates them (coerced, defaults filled in), in their JSON form.

    Raises :class:`InvalidArguments` naming every field the schema refuses, with its value.
    """
    return normalize_with(tool, validator_for(schema), arguments)


def validator_for(schema: Mapping[str, Any]) -> SchemaValidator:
    """The validator :func:`normalize` validates with for ``schema`` (built once per schema).

    Finding it writes the schema out as JSON, which costs more than the validation itself
    for a schema with a few described fields: a caller whose schema does not change (a
    catalog entry, a tool) keeps it and normalizes with :func:`normalize_with`.
    """
    return _validator(json.dumps(schema, sort_keys=True))


def normalize_with(tool: str, validator: SchemaValidator, arguments: Mapping[str, Any]
                   ) -> dict[str, Any]:
    """:func:`normalize` with the schema's validator in hand (:func:`validator_for`)."""
    try:
        result = validator.validate_python(dict(arguments))
    except ValidationError as err:
        parts = []
        for item in err.errors(include_url=False):
            field = ".".join(str(x) for x in item["loc"]) or "(arguments)"
            value = "" if item["type"] == "missing" else f" (got {shown_value(item['input'])})"
            parts.append(f"{field}: {item['msg']}{value}")
        raise InvalidArguments(f"invalid arguments for tool {tool!r}: " + "; ".join(parts)) \
            from None
    plain = to_jsonable_python(result)
    if not isinstance(plain, dict):  # a schema that is not an object schema
        raise InvalidArguments(f"invalid arguments for tool {tool!r}: not an object")
    return json_form(tool, plain)


normalize_arguments = normalize
"""The public name of :func:`normalize` (``dex_tasks.normalize_arguments``): what framework
adapters use to judge a rule on the arguments ``call_tool`` will record."""


def json_form(tool: str, validated: dict[str, Any]) -> dict[str, Any]:
    """``validated`` (the JSON form of validated arguments) if JSON can hold it; else
    :class:`InvalidArguments` naming the field ("inf" coerced to a number is valid for
    pydantic, and no JSON reader can take it back)."""
    # All at once first (one pass in C); field by field only to name the one refused.
    try:
        json.dumps(validated, allow_nan=False)
    except ValueError:
        pass
    else:
        return validated
    for name, value in validated.items():
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise InvalidArguments(
                f"invalid arguments for tool {tool!r}: {name}: the value is not finite "
                f"(got {shown_value(value)})") from None
    return validated
