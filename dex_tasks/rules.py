"""Approval rules on a call's arguments: a small JSON language, evaluated by the agent process.

``@tool(effect=..., requires_approval=when("amount_cents", ">", 10_000))`` makes a call wait for
a person only when its arguments say so ("refunds over $100 need a person").

Where the rule is evaluated, and why it is JSON and not a Python callable: the agent process
that calls ``call_tool`` imports no tool code (it reads the catalog the workers published), and
it is the one that decides, at request time, whether a call is stored ``awaiting_approval`` or
``queued``. A Python callable lives only in the worker's process; evaluating it there would
mean publishing every call to a worker first, and holding it for approval after it was already
on its way, or a round trip through a worker for every call. A declarative rule travels in the
catalog like the rest of the policy, is evaluated in microseconds where the decision is made,
has no side effects and cannot run code (no ``eval``), and is stored as it was in the call's
policy snapshot, so the audit says exactly which rule held a call and why.

The language (every node a JSON object)::

    {"field": "amount_cents", "op": ">", "value": 10000}     comparison on a (dotted) field
    {"field": "customer.tier", "op": "in", "value": ["new", "trial"]}
    {"field": "note", "op": "exists"}                          the field is present
    {"all": [rule, ...]}   {"any": [rule, ...]}   {"not": rule}

Operators: ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not_in``, ``contains``,
``exists``. A comparison on a field the arguments do not have is false (``exists`` says so
explicitly). A rule that cannot be evaluated (``"5" > 3``, a list compared with a number) raises
:class:`RuleError`; the call then waits for a person (fail closed) and its snapshot says why.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dex_tasks.errors import DexError

__all__ = ["ApprovalRule", "RuleError", "all_of", "any_of", "not_", "when"]


class RuleError(DexError):
    """A rule is malformed (when the tool is defined), or cannot be evaluated on a call's
    arguments (the call then waits for a person); the message names the field and operator."""


_ORDER: dict[str, Callable[[Any, Any], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}
OPERATORS = ("==", "!=", "<", "<=", ">", ">=", "in", "not_in", "contains", "exists")
_MISSING = object()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(node: Any, where: str = "rule") -> None:
    """:class:`RuleError` naming where ``node`` is not a rule of the language."""
    if not isinstance(node, Mapping):
        raise RuleError(f"{where} must be a JSON object, got {type(node).__name__}")
    keys = set(node)
    if keys in ({"all"}, {"any"}):
        (name,) = keys
        items = node[name]
        if not isinstance(items, list) or not items:
            raise RuleError(f"{where}.{name} must be a non-empty list of rules")
        for i, item in enumerate(items):
            _check(item, f"{where}.{name}[{i}]")
        return
    if keys == {"not"}:
        _check(node["not"], f"{where}.not")
        return
    op = node.get("op")
    if not isinstance(node.get("field"), str) or not node["field"]:
        raise RuleError(f"{where}.field must be a non-empty string (an argument's name, "
                        "dotted for a nested one)")
    if op not in OPERATORS:
        raise RuleError(f"{where}.op {op!r} is not one of: {', '.join(OPERATORS)}")
    allowed = {"field", "op"} if op == "exists" else {"field", "op", "value"}
    if keys != allowed:
        raise RuleError(f"{where} takes exactly {', '.join(sorted(allowed))}; got "
                        f"{', '.join(sorted(keys))}")
    value = node.get("value")
    if op in ("in", "not_in") and not isinstance(value, list):
        raise RuleError(f"{where}.value must be a list for op {op!r}")
    if op in _ORDER and not (_number(value) or isinstance(value, str)):
        raise RuleError(f"{where}.value must be a number or a string for op {op!r}")


def _lookup(arguments: Mapping[str, Any], path: str) -> Any:
    value: Any = arguments
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _show(value: Any) -> str:
    # Numbers print as JSON does; anything else through json.dumps (a few µs).
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)
    return json.dumps(value, sort_keys=True)


def _evaluate(node: Mapping[str, Any], arguments: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether ``node`` holds on ``arguments``, and the reason, in words."""
    if "all" in node:
        reasons = []
        for item in node["all"]:
            held, why = _evaluate(item, arguments)
            if not held:
                return False, why
            reasons.append(why)
        return True, " and ".join(reasons)
    if "any" in node:
        reasons = []
        for item in node["any"]:
            held, why = _evaluate(item, arguments)
            if held:
                return True, why
            reasons.append(why)
        return False, " and ".join(reasons)
    if "not" in node:
        held, why = _evaluate(node["not"], arguments)
        return not held, f"not ({why})"
    field, op = node["field"], node["op"]
    actual = _lookup(arguments, field)
    if op == "exists":
        return actual is not _MISSING, f"{field} {'is' if actual is not _MISSING else 'is not'} " \
            "present"
    expected = node["value"]
    if actual is _MISSING:
        return False, f"{field} is not present"
    shown = f"{field}={_show(actual)} {op} {_show(expected)}"
    if op == "==":
        held = actual == expected
    elif op == "!=":
        held = actual != expected
    elif op == "in":
        held = actual in expected
    elif op == "not_in":
        held = actual not in expected
    elif op == "contains":
        if not isinstance(actual, str | list):
            raise RuleError(f"{field} is a {type(actual).__name__}; op 'contains' needs a "
                            "string or a list")
        held = expected in actual
    else:
        both_numbers = _number(actual) and _number(expected)
        both_strings = isinstance(actual, str) and isinstance(expected, str)
        if not (both_numbers or both_strings):
            raise RuleError(f"cannot compare {field}={_show(actual)} "
                            f"({type(actual).__name__}) {op} {_show(expected)}")
        held = _ORDER[op](actual, expected)
    return held, shown if held else f"not {shown}"


@dataclass(frozen=True)
class ApprovalRule:
    """A checked rule of the language above; ``spec`` is its JSON (a dict).

    Frozen and hashable (``ToolPolicy`` is): the JSON is kept as canonical text too.
    """

    text: str

    @classmethod
    def of(cls, spec: Mapping[str, Any] | ApprovalRule) -> ApprovalRule:
        """Check ``spec`` (:class:`RuleError` naming what is wrong) and wrap it."""
        if isinstance(spec, ApprovalRule):
            return spec
        _check(spec)
        return cls(json.dumps(spec, sort_keys=True, separators=(",", ":")))

    @functools.cached_property
    def spec(self) -> dict[str, Any]:
        """The rule as JSON (a dict; shared, do not change it).

        Parsed once per rule object (the client's catalog cache keeps the policy), so a
        check per call costs the comparisons alone."""
        result: dict[str, Any] = json.loads(self.text)
        return result

    def evaluate(self, arguments: Mapping[str, Any]) -> tuple[bool, str]:
        """Whether the call needs approval, and why (the comparison that decided, in words).

        Raises :class:`RuleError` when the rule cannot be evaluated on these arguments.
        """
        try:
            return _evaluate(self.spec, arguments)
        except RuleError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of a rule fails closed
            raise RuleError(f"the rule could not be evaluated: {type(err).__name__}: "
                            f"{err}") from None


def when(field: str, op: str, value: Any = None) -> ApprovalRule:
    """A comparison rule: ``when("amount_cents", ">", 10_000)``, ``when("note", "exists")``."""
    spec: dict[str, Any] = {"field": field, "op": op}
    if op != "exists":
        spec["value"] = value
    return ApprovalRule.of(spec)


def all_of(*rules: ApprovalRule | Mapping[str, Any]) -> ApprovalRule:
    """A rule that holds when every one of ``rules`` does."""
    return ApprovalRule.of({"all": [dict(ApprovalRule.of(r).spec) for r in rules]})


def any_of(*rules: ApprovalRule | Mapping[str, Any]) -> ApprovalRule:
    """A rule that holds when one of ``rules`` does."""
    return ApprovalRule.of({"any": [ApprovalRule.of(r).spec for r in rules]})


def not_(rule: ApprovalRule | Mapping[str, Any]) -> ApprovalRule:
    """A rule that holds when ``rule`` does not."""
    return ApprovalRule.of({"not": ApprovalRule.of(rule).spec})
