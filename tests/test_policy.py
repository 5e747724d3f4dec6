"""Unit tests of policies: effect classes, defaults, MCP-hint precedence, and the @tool decorator.

Pure logic: no broker, no store, no worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from dex_tasks import (
    EffectClass,
    InvalidPolicyError,
    ToolContext,
    ToolDefinitionError,
    ToolPolicy,
    registry,
    tool,
)
from dex_tasks.policy import effect_from_hints, parse_effect, resolve_policy, seconds
from dex_tasks.registry import InvalidArguments, get_local_tool


@pytest.fixture(autouse=True)
def private_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tools defined by these tests never leak into the process-wide registry."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    yield


# -- effect classes and the defaults table ---------------------------------------------------------


@pytest.mark.parametrize(
    ("effect", "retrying", "approval"),
    [
        (EffectClass.READ, True, False),
        (EffectClass.IDEMPOTENT_WRITE, True, False),
        (EffectClass.NON_IDEMPOTENT_WRITE, False, True),
        (EffectClass.UNCLASSIFIED, False, True),
    ],
)
def test_defaults_table(effect: EffectClass, retrying: bool, approval: bool) -> None:
    policy = ToolPolicy(effect=effect)
    assert effect.retrying is retrying
    assert policy.needs_approval is approval
    # The single-attempt path never gets a second attempt, whatever the policy says.
    assert policy.attempts(default=3) == (3 if retrying else 1)


def test_explicit_approval_flag_overrides_the_effect_default() -> None:
    refund = ToolPolicy(effect="idempotent_write", requires_approval=True)
    charge = ToolPolicy(effect="non_idempotent_write", requires_approval=False)
    assert refund.needs_approval is True
    assert charge.needs_approval is False
    assert charge.attempts(default=5) == 1  # no approval, but still at most once


def test_policy_accepts_names_and_timedeltas() -> None:
    policy = ToolPolicy(effect="read", max_attempts=5, time_limit=timedelta(seconds=90),
                        approval_deadline=timedelta(hours=1))
    assert policy.effect is EffectClass.READ
    assert policy.time_limit == 90.0
    assert policy.approval_deadline == 3600.0
    assert policy.attempts(default=3) == 5


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"effect": "write"}, "'write'"),
        ({"effect": "read", "max_attempts": 0}, "max_attempts"),
        ({"effect": "read", "time_limit": -1}, "time_limit"),
        ({"effect": "read", "approval_deadline": timedelta(0)}, "approval_deadline"),
    ],
)
def test_bad_policy_values_are_refused_naming_the_field(kwargs: dict[str, Any],
                                                        names: str) -> None:
    with pytest.raises(InvalidPolicyError, match=names):
        ToolPolicy(**kwargs)


def test_policy_json_round_trip() -> None:
    policy = ToolPolicy(effect="idempotent_write", requires_approval=True, max_attempts=7,
                        time_limit=12.5, approval_deadline=60)
    assert ToolPolicy.from_json(policy.to_json()) == policy


def test_parse_effect_and_seconds() -> None:
    assert parse_effect("unclassified") is EffectClass.UNCLASSIFIED
    assert parse_effect(EffectClass.READ) is EffectClass.READ
    assert seconds(None, "x") is None
    assert seconds(timedelta(minutes=2), "x") == 120.0
    with pytest.raises(InvalidPolicyError, match="expires_in"):
        seconds(0, "expires_in")


# -- MCP hints and precedence --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hints", "expected"),
    [
        (None, None),
        ({}, None),
        ({"title": "x"}, None),
        ({"readOnlyHint": True}, EffectClass.READ),
        ({"readOnlyHint": True, "destructiveHint": True}, EffectClass.READ),
        ({"idempotentHint": True}, EffectClass.IDEMPOTENT_WRITE),
        ({"idempotentHint": True, "destructiveHint": True}, EffectClass.IDEMPOTENT_WRITE),
        ({"destructiveHint": True}, EffectClass.NON_IDEMPOTENT_WRITE),
        ({"readOnlyHint": False}, EffectClass.NON_IDEMPOTENT_WRITE),
        # Only an explicit true/false counts: a truthy string is not a hint.
        ({"readOnlyHint": "yes"}, None),
        ({"destructiveHint": False}, None),
    ],
)
def test_effect_from_mcp_hints(hints: dict[str, Any] | None,
                               expected: EffectClass | None) -> None:
    assert effect_from_hints(hints) is expected


def test_precedence_explicit_then_hints_then_session_default_then_unclassified() -> None:
    explicit = ToolPolicy(effect="non_idempotent_write")
    hints = {"readOnlyHint": True}
    assert resolve_policy(explicit, hints, "idempotent_write") is explicit
    assert resolve_policy(None, hints, "idempotent_write").effect is EffectClass.READ
    assert resolve_policy(None, {}, "idempotent_write").effect is EffectClass.IDEMPOTENT_WRITE
    assert resolve_policy(None, None, None).effect is EffectClass.UNCLASSIFIED
    assert resolve_policy(None, None, None).needs_approval is True


def test_bad_session_default_names_the_value() -> None:
    with pytest.raises(InvalidPolicyError, match="'sometimes'"):
        resolve_policy(None, None, "sometimes")


# -- the @tool decorator ---------------------------------------------------------------------------


def test_tool_with_explicit_policy_is_registered_with_schema_and_context() -> None:
    @tool(effect=EffectClass.IDEMPOTENT_WRITE, max_attempts=5, time_limit=timedelta(seconds=9),
          name="policy_test_set_flag")
    def set_flag(ctx: ToolContext, account: str, on: bool = True) -> dict[str, Any]:
        """Turn a flag on or off."""
        return {"key": ctx.idempotency_key, "attempt": ctx.attempt, "on": on}

    assert get_local_tool("policy_test_set_flag") is set_flag
    assert set_flag.explicit_policy == ToolPolicy(effect="idempotent_write", max_attempts=5,
                                                  time_limit=9)
    schema = set_flag.schema
    assert schema["required"] == ["account"]
    assert set(schema["properties"]) == {"account", "on"}
    assert set_flag.description == "Turn a flag on or off."
    ctx = ToolContext(idempotency_key="s/t/c", session_id="s", turn_id="t", tool_call_id="c",
                      attempt=2)
    assert set_flag(ctx, account="a") == {"key": "s/t/c", "attempt": 2, "on": True}


def test_tool_without_policy_records_hints_and_derives_nothing_itself() -> None:
    @tool(hints={"readOnlyHint": True}, name="policy_test_hinted")
    def hinted(ctx: ToolContext) -> None:
        return None

    assert hinted.explicit_policy is None
    assert hinted.hints == {"readOnlyHint": True}
    # The effect comes from the hints only when a call is made and no policy exists.
    assert resolve_policy(hinted.explicit_policy, hinted.hints).effect is EffectClass.READ


def test_tuning_without_an_effect_is_a_definition_error() -> None:
    with pytest.raises(ToolDefinitionError, match="effect="):

        @tool(max_attempts=3, name="policy_test_bad")
        def bad(ctx: ToolContext) -> None:
            return None


@pytest.mark.parametrize("kind", ["no_context", "var_kwargs", "keyword_only_context"])
def test_unusable_signatures_are_definition_errors(kind: str) -> None:
    def no_context() -> None:
        return None

    def var_kwargs(ctx: ToolContext, **kwargs: Any) -> None:
        return None

    def keyword_only_context(*, ctx: ToolContext) -> None:
        return None

    fn = {"no_context": no_context, "var_kwargs": var_kwargs,
          "keyword_only_context": keyword_only_context}[kind]
    with pytest.raises(ToolDefinitionError, match="policy_test_sig"):
        tool(effect="read", name="policy_test_sig")(fn)


def test_validate_coerces_and_names_every_bad_field() -> None:
    @tool(effect="read", name="policy_test_lookup")
    def lookup(ctx: ToolContext, order_id: str, limit: int = 10) -> None:
        return None

    assert lookup.validate({"order_id": "1", "limit": "5"}) == {"order_id": "1", "limit": 5}
    with pytest.raises(InvalidArguments) as err:
        lookup.validate({"limit": "many", "colour": "red"})
    message = str(err.value)
    assert "policy_test_lookup" in message
    for field in ("order_id", "limit", "colour"):
        assert field in message
