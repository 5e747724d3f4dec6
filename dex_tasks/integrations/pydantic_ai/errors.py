"""The errors the Pydantic AI adapter raises."""

from __future__ import annotations

from collections.abc import Sequence

from dex_tasks import DexError, ToolCallRecord, Turn


class ApprovalPendingError(DexError):
    """Resuming was asked for while some of the paused run's calls still wait for a person.

    ``records`` are those calls (each with its ``interrupt_id``). Resume once
    ``resolve_interrupt`` (or the deadline sweep) has decided them: Pydantic AI needs an answer
    for every deferred call of the response.
    """

    def __init__(self, records: Sequence[ToolCallRecord]) -> None:
        waiting = ", ".join(f"{r.key} (interrupt {r.interrupt_id})" for r in records)
        super().__init__(f"{len(records)} tool call(s) still wait for a person's decision: "
                         f"{waiting}; resume after resolve_interrupt has decided them")
        self.records = list(records)


class TurnInProgressError(DexError):
    """A run with a new input was started on a session whose durable turn is still open.

    The input was queued as a user message of the session (delivered when that turn ends), as
    the seeds' sessions do, and the model was not asked; finish the open turn first (run its
    own input again: ``turn``), then run this input again: its turn begins from the queued
    message, which the session holds once.
    """

    def __init__(self, session_id: str, turn: Turn) -> None:
        super().__init__(f"session {session_id!r} has an open turn ({turn.turn_id!r}, begun with "
                         f"{turn.input!r}): the new input was queued for after it; run the open "
                         "turn's input again to finish it")
        self.turn = turn
