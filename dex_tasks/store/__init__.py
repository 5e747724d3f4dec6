"""The SQL store: the one guarded transition function, its set-based twin, the claim, and
queries, one module per role:

* ``tables.py`` the tables as Core and the statements built once; ``base.py`` connections,
  transactions, retries and the post-commit hooks; ``transitions.py`` the guarded moves and
  ``moves.py`` their SQL; ``leases.py`` the claim, leases and the reads of lost work;
  ``calls.py`` inserts and reads; ``delivery.py`` queued user messages; ``keys.py`` the keys
  its processes share;
  ``deadlines.py``, ``prune.py``, ``transcript.py``, ``catalog.py`` what the sweeps and
  clients build on them.


``transition`` (and ``transition_many`` for sweeps, and ``claim``, the transition to
``running``) is the only code that writes a call's status. It is a compare-and-set
(``UPDATE ... WHERE key = :key AND status IN (:allowed)``) whose row count says whether this
caller won, and it writes the event row in the same transaction; a move to a terminal status
also appends the call's tool message to the session's transcript there.

Transitions are safe to run again, so a transition that loses its connection is run again on a
new one, for up to ``retry_seconds``. The one ambiguous case is a connection lost during
COMMIT: the first try may have committed. The retry then finds the row already in the target
state with the values that very try wrote (its ``updated_at`` is the transition's own
timestamp), takes that as won, and writes no second event or tool message.

Every call a committed transaction ended is then handed to the store's ``on_calls_ended``
hooks, after the commit and never before: that is how waiters are woken and ended calls
counted (``broker/announce.py``), with no Redis import here. A hook that fails is logged; the
transition it follows has committed and stays done.
"""

from __future__ import annotations

from dex_tasks.store.base import EndedCall, EndedHook, note_ended
from dex_tasks.store.calls import Calls
from dex_tasks.store.connections import INHERITED, NetworkBounds, bounded_statements
from dex_tasks.store.delivery import deliver_ready_messages, lock_session_messages
from dex_tasks.store.keys import Keys
from dex_tasks.store.leases import Leases
from dex_tasks.store.tables import (
    APPROVALS,
    CALLS,
    CATALOG,
    EVENTS,
    INTERRUPTS,
    MESSAGES,
    WEBHOOKS,
    event_name,
    readable_calls,
)
from dex_tasks.store.transitions import Move, Started

__all__ = [
    "APPROVALS",
    "CALLS",
    "CATALOG",
    "EVENTS",
    "INHERITED",
    "INTERRUPTS",
    "MESSAGES",
    "WEBHOOKS",
    "EndedCall",
    "EndedHook",
    "Move",
    "NetworkBounds",
    "Started",
    "Store",
    "bounded_statements",
    "deliver_ready_messages",
    "event_name",
    "lock_session_messages",
    "note_ended",
    "readable_calls",
]


class Store(Leases, Calls, Keys):
    """Access to the SQL store. Safe across fork: a child opens connections of its own.

    ``retry_seconds`` bounds how long the store's own operations (transitions, the claim,
    lease renewals, single-call reads and inserts) keep trying across lost connections and a
    busy database. ``ping_after_idle`` tests a pooled server connection that sat idle that
    many seconds before using it; for processes that idle (see
    ``connections.server_engine``).
    """
