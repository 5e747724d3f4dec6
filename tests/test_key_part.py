"""``key_part``: a framework id becomes a part of an idempotency key one-to-one (issue 18).

Before, an id that looked like a mapped id was its own part, so ``key_part(x) ==
key_part(key_part(x))`` and two different ids gave one key: the second call found the first
one's record and its tool never ran. Checked exhaustively over a small alphabet that holds
every character the mapping treats specially, and on long ids around the hashing threshold.
"""

from __future__ import annotations

import itertools

import pytest

from dex_tasks import InvalidCallError, idempotency_key, key_part
from dex_tasks.agent.calls import KEY_PART_MAX
from dex_tasks.integrations import langchain
from dex_tasks.integrations.openai_agents import context as openai_agents_context
from dex_tasks.integrations.pydantic_ai import keys as pydantic_ai_keys

ALPHABET = ["a", "7", "e", "f", "u", "~", "/", "\x00", "\x7f", "\ud800", "é"]


def every_id(length: int) -> list[str]:
    return ["".join(t) for n in range(1, length + 1)
            for t in itertools.product(ALPHABET, repeat=n)]


def test_different_ids_never_give_one_part_and_every_part_makes_a_valid_key() -> None:
    ids = every_id(4)  # 16,104 ids
    parts = {key_part(i): i for i in ids}
    assert len(parts) == len(ids)
    for part in parts:
        # A valid key of three parts: no "/", no NUL, no lone surrogate, within the limits.
        idempotency_key(part, part, part)
        part.encode("utf-8")
    # The hole that was fixed: a mapped id, given as an id, is a different id.
    for i in ids[:2000]:
        assert key_part(key_part(i)) != key_part(i) or key_part(i) == i


def test_long_ids_are_hashed_apart_from_escaped_ones_and_from_each_other() -> None:
    near = ["x" * n for n in range(KEY_PART_MAX - 2, KEY_PART_MAX + 3)]
    tricky = ["~" * 60, "~" * 54, "/" * 60, "a" * 300, "a" * 301, "é" * 200]
    ids = near + tricky + [key_part(t) for t in near + tricky]
    parts = [key_part(i) for i in ids]
    assert len(set(parts)) == len(set(ids))
    for part in parts:
        assert len(part) <= KEY_PART_MAX
        idempotency_key(part, part, part)
    assert key_part("a" * 300).startswith("a" * 100 + "~~")


def test_plain_ids_are_kept_as_they_are_and_every_adapter_maps_alike() -> None:
    for plain in ("call_abc123", "lc_run--019a-0", "resp_68a0.1", "thread 7"):
        assert key_part(plain) == plain
    assert key_part("user/42") == "user~2f42"
    assert key_part("user~2f42") == "user~7e2f42"
    assert langchain.key_part is key_part
    assert openai_agents_context.key_part is key_part
    assert pydantic_ai_keys.fit_id("user/42") == key_part("user/42")
    with pytest.raises(InvalidCallError, match="non-empty string"):
        key_part("")
