"""The keys every process of a store shares (``Store.shared_key``): made once, by whichever
process asks first, the same for every process after, with no setting; and what the ended
records' signer does while the store cannot give it one (``ended.RecordSigner``)."""

from __future__ import annotations

import logging
import multiprocessing.synchronize
from multiprocessing.queues import Queue
from typing import Any

import pytest
from sqlalchemy import text

from dex_tasks import StoreUnavailableError
from dex_tasks.broker import ended
from dex_tasks.store import Store
from dex_tasks.store.tables import KEYS
from tests.helpers import open_store, race_in_processes, wait_until


def _ask(url: str, name: str, go: multiprocessing.synchronize.Event, out: Queue[Any]) -> None:
    store = Store(url)
    try:
        go.wait()
        out.put(store.shared_key(name))
    finally:
        store.close()


def test_processes_that_ask_at_once_make_one_key_between_them(database_url: str) -> None:
    # Given a store that has no key yet
    with open_store(database_url) as store:
        assert store.reading(lambda c: c.execute(text("SELECT count(*) FROM dex_keys"))
                             .scalar_one()) == 0

    # When six processes ask for the same key at the same moment
    keys = race_in_processes(_ask, [(database_url, "ended-records")] * 6)

    # Then they got one key between them, random and long enough to sign with...
    assert len(set(keys)) == 1 and len(keys[0]) >= 40, keys
    with open_store(database_url) as later:
        # ...that a process started later reads as it is, and another name has its own
        assert later.shared_key("ended-records") == keys[0]
        assert later.shared_key("something-else") not in ("", keys[0])
        rows = later.reading(lambda c: c.execute(text("SELECT count(*) FROM dex_keys"))
                             .scalar_one())
        assert rows == 2


def test_a_key_is_read_once_per_store(database_url: str) -> None:
    # Given a store that has read its key
    with open_store(database_url) as store:
        key = store.shared_key("ended-records")

        # When the table cannot be read any more
        with store.write() as conn:
            conn.execute(KEYS.delete())
            conn.execute(text("DROP TABLE dex_keys"))

        # Then the store still has the key it read (a signer asks for it on every ending)
        assert store.shared_key("ended-records") == key


def test_the_signer_does_without_a_key_the_store_cannot_give_and_asks_again_later(
    database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(ended, "KEY_RETRY_SECONDS", 2.0)
    with open_store(database_url) as store:
        # Given a store whose keys cannot be read (a table that is gone stands for a store
        # that does not answer)
        with store.write() as conn:
            conn.execute(text("DROP TABLE dex_keys"))
        signer = ended.RecordSigner(store)

        # When the signer is asked for its serializer
        with caplog.at_level(logging.WARNING, logger="dex_tasks.broker.ended"):
            first = signer.serializer()

        # Then there is none (announcements carry only the status, waiters read the store),
        # which is said once, naming why, and the store is not asked again at once
        assert first is None
        warned = [r for r in caplog.records if getattr(r, "action", "") ==
                  "record_key_unavailable"]
        assert len(warned) == 1 and "dex_keys" in str(getattr(warned[0], "error", ""))
        with pytest.raises(StoreUnavailableError):
            store.shared_key(ended.RECORD_KEY_NAME)
        KEYS.create(store.engine)
        assert signer.serializer() is None

        # And once the store answers again, a later ask signs with the store's key
        wait_until(lambda: signer.serializer() is not None, 10, "the signer to get its key")
        serializer = signer.serializer()
        assert serializer is not None
        made = serializer.dumps({"key": "s/t/c"})
        checked = ended.record_serializer(store.shared_key(ended.RECORD_KEY_NAME))
        assert checked.loads(made) == {"key": "s/t/c"}
