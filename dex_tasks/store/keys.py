"""Keys shared by every process of one store (``dex_keys``), made by the first that needs one.

The store is what every process of a deployment already shares and trusts: a producer, the
workers, beat and the API all read the same database, and only they can. A key kept there
needs no configuration and no distribution, and a process that cannot read the store cannot
learn it, which is what signing something that travels through Redis asks for (the ended
records handed to waiters, ``broker/ended.py``).
"""

from __future__ import annotations

import secrets
import time

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from dex_tasks.errors import StoreUnavailableError
from dex_tasks.store.base import StoreBase
from dex_tasks.store.tables import KEYS

KEY_BYTES = 32
"""Random bytes in a made key (``secrets.token_urlsafe``: 43 characters)."""


class Keys(StoreBase):
    """The store's shared keys."""

    def shared_key(self, name: str) -> str:
        """The key called ``name``: read once per Store, made at random by the first process
        that asks for it. Processes that ask at once make one between them (the insert does
        nothing where the key exists, and each then reads the one that was kept). Raises
        :class:`~dex_tasks.errors.StoreUnavailableError` as the store's reads do."""
        found = self.shared_keys.get(name)
        if found is None:
            found = self._read_key(name)
            if found is None:
                insert = sqlite_insert if self.is_sqlite else pg_insert
                made = insert(KEYS).values(name=name, value=secrets.token_urlsafe(KEY_BYTES),
                                           created_at=time.time())
                # Safe to run again after a lost COMMIT: a second try inserts nothing.
                self.writing(lambda conn: conn.execute(made.on_conflict_do_nothing()))
                found = self._read_key(name)
                if found is None:  # deleted between the two statements (a key rotated)
                    raise StoreUnavailableError(f"the store's key {name!r} was made and is gone")
            self.shared_keys[name] = found
        return found

    def _read_key(self, name: str) -> str | None:
        rows = self._fetch(select(KEYS.c.value).where(KEYS.c.name == name))
        return str(rows[0]["value"]) if rows else None
