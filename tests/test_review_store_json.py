"""Issue 19, finding 9: a repeated call compares its arguments as jsonb keeps numbers.

PostgreSQL's jsonb stores ``1e23`` as exactly 10**23 and hands it back as an int; the float
1e23 is not 10**23 in binary, so a repeat of ``{"x": 1e23}`` raised ConflictError there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dex_tasks import ConflictError, DexClient, define_tool, registry
from dex_tasks.store.sqljson import same_json
from tests.conftest import fast_settings


@pytest.fixture
def db_client(redis_url: str, database_url: str,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[DexClient]:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    define_tool("json_probe", {"type": "object"}, lambda ctx, arguments: arguments,
                effect="read")
    with DexClient(fast_settings(redis_url, database_url)) as client:
        yield client


def test_numbers_compare_by_the_decimal_their_text_spells() -> None:
    assert same_json('{"x":100000000000000000000000}', '{"x":1e+23}')
    assert same_json('{"x":[1.5e300]}', '{"x":[15' + "0" * 299 + ']}')
    assert not same_json('{"x":99999999999999991611392}', '{"x":1e+23}')
    assert not same_json('{"x":0.1}', '{"x":0.10000000000000002}')


@pytest.mark.parametrize("value", [1e23, 1.5e300, 12345678901234567890.0, -2e22])
def test_a_repeated_call_with_a_large_float_is_the_same_call(
    db_client: DexClient, value: float
) -> None:
    first = db_client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                tool="json_probe", arguments={"x": value})
    again = db_client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                tool="json_probe", arguments={"x": value})
    assert again.key == first.key
    with pytest.raises(ConflictError, match="arguments"):
        db_client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                            tool="json_probe", arguments={"x": value * 2})
