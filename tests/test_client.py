"""DexClient without a worker: what call_tool records and sends, lookups, waits, bad input.

Running calls end to end is covered by the guarantee tests; here a queued call's message is
checked in Redis directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dex_tasks import (
    CallNotFoundError,
    CallStatus,
    DexClient,
    DexSettings,
    EffectClass,
    InvalidCallError,
    InvalidPolicyError,
    ToolContext,
    idempotency_key,
    registry,
    tool,
)
from dex_tasks.broker.routing import queue_for
from dex_tasks.store import catalog as catalog_mod
from dex_tasks.worker.execution import Runtime
from tests.conftest import fast_settings
from workers import example_tools

assert example_tools.lookup_order.name == "lookup_order"


@pytest.fixture
def settings(redis_url: str, database_url: str) -> DexSettings:
    """Both stores: what call_tool stores, repeats and reads back must not depend on the engine
    (PostgreSQL's jsonb hands JSON back in its own spelling)."""
    return fast_settings(redis_url, database_url)


@pytest.fixture
def private_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    yield


def test_from_env_reads_the_dex_variables(monkeypatch: pytest.MonkeyPatch,
                                          settings: DexSettings) -> None:
    monkeypatch.setenv("DEX_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("DEX_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("DEX_SECRET_KEY", "from-the-environment")
    with DexClient.from_env() as client:
        assert client.settings.redis_url == settings.redis_url
        assert client.settings.database_url == settings.database_url
        assert client.settings.secret_key.get_secret_value() == "from-the-environment"
        # The tables exist: a lookup answers instead of failing.
        with pytest.raises(CallNotFoundError):
            client.get_tool_call("s/t/c")


def test_call_tool_records_the_call_and_sends_one_message(client: DexClient,
                                                          rt: Runtime) -> None:
    before = time.time()
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="lookup_order", arguments={"order_id": "1001"})
    assert record.key == "s1/t1/c1" == idempotency_key("s1", "t1", "c1")
    assert (record.session_id, record.turn_id, record.tool_call_id) == ("s1", "t1", "c1")
    # The arguments the tool will run with: its default filled in (issue 28 item 1)
    assert record.tool == "lookup_order"
    assert record.arguments == {"order_id": "1001", "sleep": 0.0}
    assert record.effect is EffectClass.READ and record.requires_approval is False
    assert record.status is CallStatus.QUEUED and not record.terminal
    assert record.attempts == 0 and record.max_attempts == 3
    assert record.result is None and record.error is None and record.finished_at is None
    assert record.created_at.timestamp() >= before
    assert rt.redis.llen(queue_for("lookup_order")) == 1
    # The message carries only the key: the store holds the rest.
    assert client.get_tool_call(record.key) == record


def test_concurrent_call_tool_with_one_key_make_one_call(client: DexClient,
                                                         rt: Runtime) -> None:
    # Given an agent that retries its request from several threads at once
    start = threading.Barrier(6)

    def call(_: int) -> Any:
        start.wait()
        return client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                tool="charge_card",
                                arguments={"customer_id": "cu_1", "amount_cents": 5})

    with ThreadPoolExecutor(6) as pool:
        records = list(pool.map(call, range(6)))
    # Then they all got the same record, and one message was sent
    assert all(r.key == records[0].key for r in records)
    assert rt.redis.llen(queue_for("charge_card")) == 1
    assert len(client.get_agent_snapshot("s1").tool_calls) == 1


def test_calls_needing_approval_send_no_message(client: DexClient, rt: Runtime) -> None:
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="refund_payment",
                              arguments={"charge_id": "ch_1", "amount_cents": 5})
    assert record.status is CallStatus.AWAITING_APPROVAL
    assert record.requires_approval and record.interrupt_id
    assert rt.redis.llen(queue_for("refund_payment")) == 0


def test_policy_comes_from_the_catalog_hints_or_the_session_default(
    client: DexClient, rt: Runtime, private_registry: None
) -> None:
    # Given tools only a worker knows: one with a policy, one with MCP hints, one with neither
    @tool(effect="idempotent_write", max_attempts=5, name="client_test_set")
    def set_value(ctx: ToolContext, value: int) -> int:
        return value

    @tool(hints={"readOnlyHint": True}, name="client_test_hinted")
    def hinted(ctx: ToolContext) -> None:
        return None

    @tool(name="client_test_plain")
    def plain(ctx: ToolContext) -> None:
        return None

    catalog_mod.publish(client.store, [set_value, hinted, plain])
    for name in ("client_test_set", "client_test_hinted", "client_test_plain"):
        del registry._REGISTRY[name]

    def call(call_id: str, name: str, **kw: Any) -> Any:
        return client.call_tool(session_id="s1", turn_id="t1", tool_call_id=call_id, tool=name,
                                arguments=kw.pop("arguments", {}), **kw)

    explicit = call("c1", "client_test_set", arguments={"value": 3},
                    default_effect="non_idempotent_write")
    assert (explicit.effect, explicit.max_attempts) == (EffectClass.IDEMPOTENT_WRITE, 5)
    assert call("c2", "client_test_hinted", default_effect="idempotent_write").effect \
        is EffectClass.READ
    defaulted = call("c3", "client_test_plain", default_effect="idempotent_write")
    assert defaulted.effect is EffectClass.IDEMPOTENT_WRITE and defaulted.status.value == "queued"
    unclassified = call("c4", "client_test_plain")
    assert unclassified.effect is EffectClass.UNCLASSIFIED
    assert unclassified.status is CallStatus.AWAITING_APPROVAL and unclassified.max_attempts == 1

    # When the tool's policy changes later, the calls already made keep their snapshot
    @tool(effect="non_idempotent_write", requires_approval=True, name="client_test_set")
    def set_value_v2(ctx: ToolContext, value: int) -> int:
        return value

    catalog_mod.publish(client.store, [set_value_v2])
    del registry._REGISTRY["client_test_set"]
    # (the client caches catalog entries for catalog_cache_seconds; skip the wait)
    client.refresh_catalog()
    assert client.get_tool_call(explicit.key).effect is EffectClass.IDEMPOTENT_WRITE
    later = call("c5", "client_test_set", arguments={"value": 3})
    assert later.effect is EffectClass.NON_IDEMPOTENT_WRITE
    assert later.status is CallStatus.AWAITING_APPROVAL


def test_lookups_waits_and_snapshots(client: DexClient) -> None:
    with pytest.raises(CallNotFoundError, match="'s1/t1/nope'"):
        client.get_tool_call("s1/t1/nope")
    with pytest.raises(CallNotFoundError):
        client.wait("s1/t1/nope", timeout=0.1)
    queued = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="lookup_order", arguments={"order_id": "1001"})
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still queued after 0\.2s"):
        client.wait(queued.key, timeout=0.2)
    assert time.monotonic() - started < 2
    invalid = client.call_tool(session_id="s1", turn_id="t2", tool_call_id="c1",
                               tool="lookup_order", arguments={})
    assert client.wait(invalid.key, timeout=1).status is CallStatus.FAILED
    client.call_tool(session_id="s2", turn_id="t1", tool_call_id="c1",
                     tool="lookup_order", arguments={"order_id": "1002"})
    snapshot = client.get_agent_snapshot("s1")
    assert snapshot.session_id == "s1"
    assert [c.key for c in snapshot.tool_calls] == [queued.key, invalid.key]
    assert client.get_agent_snapshot("nobody").tool_calls == []


@pytest.mark.parametrize(
    ("ids", "arguments", "names"),
    [
        (("", "t1", "c1"), {}, "session_id"),
        (("s1", "t/1", "c1"), {}, "turn_id"),
        (("s1", "t1", None), {}, "tool_call_id"),
        (("s1", "t1", "c1"), ["order_id", "1001"], "arguments"),
    ],
)
def test_malformed_calls_are_refused_naming_the_field(
    client: DexClient, ids: tuple[Any, Any, Any], arguments: Any, names: str
) -> None:
    session_id, turn_id, tool_call_id = ids
    with pytest.raises(InvalidCallError, match=names):
        client.call_tool(session_id=session_id, turn_id=turn_id, tool_call_id=tool_call_id,
                         tool="lookup_order", arguments=arguments)
    assert client.get_agent_snapshot("s1").tool_calls == []


@pytest.mark.parametrize("field", ["expires_in", "approval_deadline"])
def test_bad_durations_are_refused_naming_the_field(client: DexClient, field: str) -> None:
    with pytest.raises(InvalidPolicyError, match=field):
        client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                         tool="lookup_order", arguments={"order_id": "1001"},
                         **{field: -5})
    assert client.get_agent_snapshot("s1").tool_calls == []


def test_a_store_with_no_catalog_says_so_instead_of_unknown_tool(
    database_url: str, redis_url: str
) -> None:
    # Given an agent whose database is not the workers' (nothing was ever published to it),
    # with a password in its URL
    from sqlalchemy.engine import make_url

    from dex_tasks.errors import UnknownToolError
    from tests.conftest import fast_settings

    url = make_url(database_url)
    if url.get_backend_name() == "postgresql":
        url = url.set(password="s3cret-pw")  # trust auth on the test server ignores it
    with DexClient(fast_settings(redis_url, url.render_as_string(hide_password=False))) as c:
        # When it calls a tool it does not have locally
        with pytest.raises(UnknownToolError) as err:
            c.call_tool(session_id="s", turn_id="t", tool_call_id="c", tool="lookup_orders",
                        arguments={})
        # Then the error points at the database, without its password
        text = str(err.value)
        assert err.value.tool == "lookup_orders"
        assert "no worker has published tools to " + url.render_as_string() in text
        assert "is DEX_DATABASE_URL the one the workers use?" in text
        assert "s3cret-pw" not in text

        # And once a worker has published a catalog, a name it lacks is an unknown tool
        catalog_mod.publish(c.store, [example_tools.lookup_order])
        with pytest.raises(UnknownToolError, match="unknown tool 'lookup_orders'") as err:
            c.call_tool(session_id="s", turn_id="t", tool_call_id="c", tool="lookup_orders",
                        arguments={})
        assert err.value.empty_catalog_at is None


def test_an_empty_catalog_names_the_file_a_relative_sqlite_url_opens(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an agent started in another folder than the workers, on sqlite:///dex.db
    from dex_tasks.errors import UnknownToolError
    from tests.conftest import fast_settings

    monkeypatch.chdir(tmp_path)
    with DexClient(fast_settings(redis_url, "sqlite:///dex.db")) as c:
        with pytest.raises(UnknownToolError) as err:
            c.call_tool(session_id="s", turn_id="t", tool_call_id="c", tool="lookup_orders",
                        arguments={})
    # Then the error says which file that is, and that it depends on the folder
    assert (f"no worker has published tools to sqlite:///dex.db (the file {tmp_path}/dex.db, "
            "relative to this process's folder)") in str(err.value)
