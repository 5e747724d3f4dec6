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
class ToolPolicy:
    """How calls of one tool run.

    ``requires_approval=None`` means "as the effect class says"; ``True`` makes every call wait for
    a person; ``False`` lets a non-idempotent write run without approval (still at most once).
    ``max_attempts`` only matters on the retrying path; the single-attempt path is always 1.
    ``time_limit`` and ``approval_deadline`` are in seconds.
    """

    effect: EffectClass = EffectClass.UNCLASSIFIED
    requires_approval: bool | None = None
    max_attempts: int | None = None
    time_limit: float | None = None
    approval_deadline: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "effect", parse_effect(self.effect))
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
        return self.requires_approval

    def attempts(self, default: int) -> int:
        """How many attempts a call may use: 1 on the single-attempt path."""
        if not self.effect.retrying:
            return 1
        return self.max_attempts or default

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe form for the catalog."""
        return {
            "effect": self.effect.value,
            "requires_approval": self.requires_approval,
            "max_attempts": self.max_attempts,
            "time_limit": self.time_limit,
            "approval_deadline": self.approval_deadline,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToolPolicy:
        """Inverse of :meth:`to_json`."""
        return cls(
            effect=parse_effect(data["effect"]),
            requires_approval=data.get("requires_approval"),
            max_attempts=data.get("max_attempts"),
            time_limit=data.get("time_limit"),
            approval_deadline=data.get("approval_deadline"),
        )


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
