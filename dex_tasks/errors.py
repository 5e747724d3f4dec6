"""The exception tree of dex-tasks.

Every error the library raises on purpose derives from :class:`DexError`, so an agent loop can
catch one type. The tree::

    DexError
    ├── ConfigurationError      a setting is missing or malformed
    │   ├── SchemaOutOfDateError  the store's schema is not this release's (run `db upgrade`)
    │   ├── StoreRefusedError     the store refused for a reason waiting cannot fix (also a
    │   │                         StoreUnavailableError)
    │   └── BrokerRefusedError    Redis refused the password or a command (ACL)
    ├── UnknownToolError        no local tool and no catalog entry has that name (or no catalog)
    ├── ToolDefinitionError     a @tool function cannot be turned into a tool
    ├── ConflictError           the idempotency key exists with another tool or other arguments
    │   └── TurnConflictError   a durable turn's step or turn id already journaled otherwise
    ├── CallNotFoundError       no call is stored under that key
    ├── IllegalTransitionError  code asked the store for a status change the state machine forbids
    ├── StoreUnavailableError   the SQL store could not be reached or refused the statement
    ├── InvalidArgumentError    an argument of a public function is malformed (names the field)
    │   └── InvalidCallError    a call_tool argument is malformed (an id, the arguments)
    ├── InvalidTokenError       an approval token is missing, forged, malformed or expired (401)
    ├── ForbiddenSessionError   a valid token for another session, or without permission (403)
    └── CallFailure             raised by a worker's task after the store recorded the call's
        ├── CallFailed          end, so that Celery's own state (Flower, ``celery events``)
        └── CallOutcomeUnknown  says FAILURE too; callers never see it

:class:`TransientToolError` and :class:`OutcomeUnknownError` are not ``DexError``s: tools raise
them, to ask for a retry, or to say they cannot tell whether their effect happened.
"""

from __future__ import annotations

from collections.abc import Sequence


class DexError(Exception):
    """Root of every error dex-tasks raises."""


class ConfigurationError(DexError):
    """A setting is missing or has a value dex-tasks cannot use."""


class SchemaOutOfDateError(ConfigurationError):
    """The store's schema is older than this dex-tasks needs, newer than it knows, or from
    before migrations. The message (one line) names the store and what to run: usually
    ``dex-tasks db upgrade``."""


class UnknownToolError(DexError):
    """No tool of that name is registered locally or published in the catalog."""

    def __init__(self, tool: str, *, empty_catalog_at: str | None = None,
                 suggestions: Sequence[str] = ()) -> None:
        if empty_catalog_at is not None:
            # Nothing published at all: far more often the wrong database than a wrong name.
            message = (f"tool {tool!r} is not registered in this process, and no worker has "
                       f"published tools to {empty_catalog_at}: is DEX_DATABASE_URL the one "
                       "the workers use?")
        else:
            message = (f"unknown tool {tool!r}: no @tool of that name is registered in this "
                       "process and no worker has published it to the catalog")
            if suggestions:
                message += "; did you mean " + " or ".join(repr(s) for s in suggestions) + "?"
        super().__init__(message)
        self.tool = tool
        self.empty_catalog_at = empty_catalog_at
        self.suggestions = tuple(suggestions)


class ToolDefinitionError(DexError):
    """A function decorated with ``@tool`` cannot be turned into a tool."""


class ConflictError(DexError):
    """The idempotency key is already used by a call with another tool or other arguments."""

    def __init__(self, key: str, field: str) -> None:
        what = {"tool": "another tool", "arguments": "other arguments"}.get(
            field, f"another {field}")
        super().__init__(f"idempotency key {key!r} is already used by a call with {what}; a "
                         "key names exactly one call")
        self.key = key
        self.field = field


class TurnConflictError(ConflictError):
    """A durable turn already journaled something else at this place: another model response
    for a step, a step after the turn ended, another input or answer for the turn id.

    ``key`` names the turn (``session/turn``, with ``#step`` for a step); ``field`` what
    differs.
    """

    def __init__(self, key: str, field: str, detail: str = "") -> None:
        DexError.__init__(self, f"{key!r} is already journaled with a different {field}"
                                f"{': ' + detail if detail else ''}; a step records exactly "
                                "one model response, and a turn one input and one answer")
        self.key = key
        self.field = field


class PrunedCallError(ConflictError):
    """The idempotency key names a single-attempt call that ran and was pruned since.

    ``dex-tasks prune`` keeps a tombstone of each such key: a non-idempotent write is never run
    twice, so a replay of it under the same ids is refused rather than run again (or ended
    "did not run" although it ran). A new call needs new ids.
    """

    def __init__(self, key: str) -> None:
        DexError.__init__(self, f"idempotency key {key!r} names a call that ran and was pruned "
                          "(dex-tasks prune); a single-attempt call is never run again, so it "
                          "cannot be replayed: a new call needs new ids")
        self.key = key
        self.field = "pruned"


class CallNotFoundError(DexError):
    """No call is stored under that idempotency key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no tool call is stored under key {key!r}")
        self.key = key


class IllegalTransitionError(DexError):
    """A status change that the call state machine does not allow was requested."""


class StoreUnavailableError(DexError):
    """The SQL store could not be reached, or it refused a statement."""


class StoreRefusedError(StoreUnavailableError, ConfigurationError):
    """The store answered, and refused for a reason that waiting cannot fix: the login (a
    wrong password, a role or database that does not exist, a host pg_hba.conf does not
    allow), or a pooler in front of it that refuses a startup parameter or keeps no prepared
    statements. The message (one line, no password) names the cause and the fix. Nothing
    retries it; processes that start against it exit at once."""


class BrokerRefusedError(ConfigurationError):
    """Redis answered, and refused for a reason that waiting cannot fix: the password
    (``WRONGPASS``, ``NOAUTH``) or a command dex-tasks needs (an ACL user without it,
    ``NOPERM``). The message (one line, no password) names the cause and the fix."""


class InvalidArgumentError(DexError, ValueError):
    """An argument of a public function has the wrong type or value; the message names it."""


class InvalidCallError(InvalidArgumentError):
    """A ``call_tool`` argument is malformed: an id that is empty, too long, holds ``/``, a NUL
    byte or a lone surrogate, or arguments that are not a JSON object. Names the field."""


class InvalidTokenError(DexError):
    """An approval token is missing, malformed, forged or expired: the caller is not known."""


class ForbiddenSessionError(DexError):
    """A valid token that does not allow this: it is bound to another session, or it lacks the
    permission to operate the session. The caller is known but not allowed."""


class TransientToolError(Exception):
    """Raise from a tool to ask for another attempt on the retrying path.

    On the single-attempt path it is treated like any other failure: the call ends ``failed``.
    ``retry_after`` (seconds) overrides the computed backoff when the service said how long to
    wait, within bounds: never more than ``DEX_RETRY_BACKOFF_MAX_SECONDS`` (``inf`` included), a
    negative value means no wait, and ``nan`` is ignored (see ``retry.bounded_retry_after``).
    """

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class OutcomeUnknownError(Exception):
    """Raise from a tool when it cannot tell whether its effect happened.

    A request timed out after it was sent, a connection dropped before the answer came: the
    service may or may not have acted. The call ends ``outcome_unknown`` (its error starts with
    ``OUTCOME_UNKNOWN_TOOL_RESULT`` and carries this message) and is never run again, on either
    path, not even for a ``read`` with attempts left. Reconcile it with the service by the
    call's idempotency key.
    """


class CallFailure(DexError):
    """Raised by a worker's task body after the store recorded that its call did not succeed.

    The store is the record; this exception only makes Celery's own state for the message
    (what Flower and ``celery events`` show) agree with it: ``FAILURE``, with the call's error
    text and never its arguments. The task kinds list it in ``Task.throws``, so Celery logs it
    as an expected failure (one INFO line, no traceback), and ``main_process.DexRequest``
    knows it for what it is: the call's end, not a lost worker, nothing to requeue or retry.

    It takes exactly one argument, the error text, so it pickles between the worker's child and
    its main process like any plain exception.
    """

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


class CallFailed(CallFailure):
    """The call ended ``failed``: the tool raised, its attempts ran out, or it never started."""


class CallOutcomeUnknown(CallFailure):
    """The call ended ``outcome_unknown``: the tool may or may not have taken effect."""
