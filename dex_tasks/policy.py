"""Effect classes, tool policies, and how a call's policy is decided.

The effect class of a tool decides how its calls run:

* ``read`` and ``idempotent_write`` take the retrying path: the message is acknowledged late,
  redelivered when a worker is lost, and retried with backoff on transient errors.
* ``non_idempotent_write`` and ``unclassified`` take the single-attempt path: acknowledged early,
  claimed once, never run twice; they wait for approval unless the policy says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

from dex_tasks.errors import DexError
from dex_tasks.rules import ApprovalRule, RuleError


class EffectClass(str, Enum):
    """What running a tool does to the world, and so whether it may run again."""

    READ = "read"
    IDEMPOTENT_WRITE = "idempotent_write"
    NON_IDEMPOTENT_WRITE = "non_idempotent_write"
    UNCLASSIFIED = "unclassified"

    @property
    def retrying(self) -> bool:
        """True when calls of this class may be attempted more than once."""
        return self in (EffectClass.READ, EffectClass.IDEMPOTENT_WRITE)

    @property
    def approval_by_default(self) -> bool:
        """Whether calls wait for a person when the policy does not say."""
        return not self.retrying


RETRYING_EFFECTS = frozenset(e.value for e in EffectClass if e.retrying)
"""The stored ``effect`` values of the retrying path. A row whose effect is none of the classes
(written by hand, or by another release) is not in it, and code that sorts rows by path asks
this set rather than ``EffectClass(row.effect)``, which would raise on such a row and stop a
sweep's whole batch."""


class InvalidPolicyError(DexError):
    """A policy field has a value that cannot be used."""


def parse_effect(value: EffectClass | str) -> EffectClass:
    """Accept an ``EffectClass`` or its lowercase name; name the bad value otherwise."""
    if isinstance(value, EffectClass):
        return value
    try:
        return EffectClass(value)
    except ValueError:
        allowed = ", ".join(e.value for e in EffectClass)
        raise InvalidPolicyError(f"effect {value!r} is not one of: {allowed}") from None


def seconds(value: float | int | timedelta | None, field: str) -> float | None:
    """Normalise a duration given in seconds or as a ``timedelta``; refuse negatives."""
    if value is None:
        return None
    result = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if result <= 0:
        raise InvalidPolicyError(f"{field} must be positive, got {value!r}")
    return result


@dataclass(frozen=True)
class ApprovalDecision:
    """Whether one call waits for a person, and what decided it (kept in its snapshot).

    ``rule`` is the rule's JSON when an :class:`~dex_tasks.rules.ApprovalRule` decided;
    ``reason`` says why in words; ``error`` is set when the rule could not be evaluated (the
    call then waits: fail closed).
    """

    required: bool
    rule: dict[str, Any] | None = None
    reason: str | None = None
    error: str | None = None

    def snapshot(self) -> dict[str, Any] | None:
        """What the call's policy snapshot keeps (None when no rule decided)."""
        if self.rule is None:
            return None
        return {"rule": self.rule, "required": self.required, "reason": self.reason,
                "error": self.error}


# The decisions of a policy without a rule, made once (a decision is immutable).
_BY_FLAG = {flag: ApprovalDecision(flag) for flag in (False, True)}


@dataclass(frozen=True)
class ToolPolicy:
    """How calls of one tool run.

    ``requires_approval=None`` means "as the effect class says"; ``True`` makes every call wait for
    a person; ``False`` lets a non-idempotent write run without approval (still at most once).
    ``max_attempts`` only matters on the retrying path; the single-attempt path is always 1.
    ``time_limit`` and ``approval_deadline`` are in seconds.

    ``requires_approval`` may also be an :class:`~dex_tasks.rules.ApprovalRule` (or its JSON):
    a call waits when the rule holds on its arguments (:meth:`approval_for`). ``approvals=N``
    asks for N approvals from distinct approvers, each holding ``approver_permission`` in their
    token when it is set; the first rejection decides. ``webhooks`` are URLs told about this
    tool's approvals, besides ``DEX_WEBHOOK_URLS``. ``allow_self_approval`` lets the identity
    that made a call (the MCP client's token) decide it too; by default such a decision is
    refused (:class:`~dex_tasks.agent.approvals.SelfApprovalError`), so the agent whose model a
    person is meant to check cannot approve its own calls.
    """

    effect: EffectClass = EffectClass.UNCLASSIFIED
    requires_approval: bool | ApprovalRule | None = None
    max_attempts: int | None = None
    time_limit: float | None = None
    approval_deadline: float | None = None
    approvals: int = 1
    approver_permission: str | None = None
    webhooks: tuple[str, ...] = ()
    allow_self_approval: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "effect", parse_effect(self.effect))
        rule = self.requires_approval
        if rule is not None and not isinstance(rule, bool):
            try:
                object.__setattr__(self, "requires_approval", ApprovalRule.of(rule))
            except RuleError as err:
                raise InvalidPolicyError(f"requires_approval: {err}") from None
        if isinstance(self.approvals, bool) or not isinstance(self.approvals, int) \
                or self.approvals < 1:
            raise InvalidPolicyError(f"approvals must be an integer of at least 1, got "
                                     f"{self.approvals!r}")
        if self.approver_permission is not None:
            check_permission_name(self.approver_permission, "approver_permission")
        if isinstance(self.webhooks, str):
            raise InvalidPolicyError("webhooks must be a list of URLs, not one string")
        urls = tuple(self.webhooks)
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise InvalidPolicyError(f"webhooks: {url!r} is not an http(s) URL")
        object.__setattr__(self, "webhooks", urls)
        if not isinstance(self.allow_self_approval, bool):
            raise InvalidPolicyError(f"allow_self_approval must be a boolean, got "
                                     f"{self.allow_self_approval!r}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise InvalidPolicyError(f"max_attempts must be at least 1, got {self.max_attempts}")
        object.__setattr__(self, "time_limit", seconds(self.time_limit, "time_limit"))
        object.__setattr__(
            self, "approval_deadline", seconds(self.approval_deadline, "approval_deadline")
        )

    @property
    def needs_approval(self) -> bool:
        """The approval rule in force: the explicit flag, else the effect class default."""
        if self.requires_approval is None:
            return self.effect.approval_by_default
        # A rule: some calls may wait, so callers that cannot look at arguments ask.
        return bool(self.requires_approval)

    def approval_for(self, arguments: Mapping[str, Any]) -> ApprovalDecision:
        """Whether a call with these arguments waits for a person, and why.

        A rule that raises makes the call wait (fail closed), with the error in the decision.
        """
        rule = self.requires_approval
        if not isinstance(rule, ApprovalRule):
            return _BY_FLAG[self.needs_approval]
        try:
            required, reason = rule.evaluate(arguments)
        except RuleError as err:
            return ApprovalDecision(True, rule.spec, "the rule could not be evaluated, so a "
                                    "person decides", str(err))
        return ApprovalDecision(required, rule.spec, reason)

    def attempts(self, default: int) -> int:
        """How many attempts a call may use: 1 on the single-attempt path."""
        if not self.effect.retrying:
            return 1
        return self.max_attempts or default

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe form for the catalog."""
        rule = self.requires_approval
        data: dict[str, Any] = {
            "effect": self.effect.value,
            "requires_approval": rule.spec if isinstance(rule, ApprovalRule) else rule,
            "max_attempts": self.max_attempts,
            "time_limit": self.time_limit,
            "approval_deadline": self.approval_deadline,
        }
        # Only when set: a catalog row of a plain policy stays what older releases read.
        if self.approvals != 1:
            data["approvals"] = self.approvals
        if self.approver_permission is not None:
            data["approver_permission"] = self.approver_permission
        if self.webhooks:
            data["webhooks"] = list(self.webhooks)
        if self.allow_self_approval:
            data["allow_self_approval"] = True
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToolPolicy:
        """Inverse of :meth:`to_json`."""
        return cls(
            effect=parse_effect(data["effect"]),
            requires_approval=data.get("requires_approval"),
            max_attempts=data.get("max_attempts"),
            time_limit=data.get("time_limit"),
            approval_deadline=data.get("approval_deadline"),
            approvals=data.get("approvals", 1),
            approver_permission=data.get("approver_permission"),
            webhooks=tuple(data.get("webhooks") or ()),
            allow_self_approval=data.get("allow_self_approval", False),
        )


def check_permission_name(value: Any, field: str = "permission",
                          error: type[DexError] = InvalidPolicyError) -> str:
    """``value`` if it can name a permission in a token (letters, digits, ``._:-``, at most 64
    characters); ``error`` (:class:`InvalidPolicyError`) naming ``field`` otherwise."""
    if not isinstance(value, str) or not 0 < len(value) <= 64 or not all(
            c.isascii() and (c.isalnum() or c in "._:-") for c in value):
        raise error(f"{field} must be 1 to 64 letters, digits or ._:- , got "
                                 f"{value!r}")
    return value


def effect_from_hints(hints: Mapping[str, Any] | None) -> EffectClass | None:
    """Derive an effect class from MCP tool annotations, or None when they say nothing.

    MCP annotations are hints from the tool's author and untrusted by the MCP spec itself, so
    only an explicit ``true``/``false`` counts; missing hints leave the decision to the next
    source. ``idempotentHint`` is about repeated calls having no extra effect, which is exactly
    what the retrying path needs, destructive or not.
    """
    if not hints:
        return None
    if hints.get("readOnlyHint") is True:
        return EffectClass.READ
    if hints.get("idempotentHint") is True:
        return EffectClass.IDEMPOTENT_WRITE
    if hints.get("destructiveHint") is True or hints.get("readOnlyHint") is False:
        return EffectClass.NON_IDEMPOTENT_WRITE
    return None


def resolve_policy(
    explicit: ToolPolicy | None,
    hints: Mapping[str, Any] | None = None,
    session_default: EffectClass | str | None = None,
) -> ToolPolicy:
    """Decide a tool's policy: explicit policy > MCP hints > session default > unclassified."""
    if explicit is not None:
        return explicit
    from_hints = effect_from_hints(hints)
    if from_hints is not None:
        return ToolPolicy(effect=from_hints)
    if session_default is not None:
        return ToolPolicy(effect=parse_effect(session_default))
    return ToolPolicy(effect=EffectClass.UNCLASSIFIED)
