"""Request and response bodies of the HTTP API (its OpenAPI schema comes from these).

The resolve route's body is checked by :func:`parse_resolve_body`, not by FastAPI: the route must
verify the token before a byte of the body is read, and a wrong body gets the seeds' exact
texts (``{"error": "approved must be a boolean"}``), not a validation dump.
:class:`ResolveRequest` documents the same rules in OpenAPI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from dex_tasks.limits import text_problem
from dex_tasks.store.records import AgentSnapshot

MAX_SESSION_ID_LENGTH = 200
MAX_INTERRUPT_ID_LENGTH = 64
MAX_REJECTION_MESSAGE_LENGTH = 4000

# The seeds' texts, word for word: clients written against the seeds match on them.
INTERRUPT_ID_ERROR = "interrupt_id must be a non-empty string"
APPROVED_ERROR = "approved must be a boolean"
REJECTION_MESSAGE_ERROR = "rejection_message must be a string"


class ResolveRequest(BaseModel):
    """A person's decision on one pending approval (the seeds' body).

    The session is the token's. ``session_id`` may be sent too; it must then be the token's
    session (else 403). An operator token names no session, so with one it is required.
    Fields not listed here are refused: a misspelt ``rejection_mesage`` must not silently drop
    the message the model was meant to read.
    """

    model_config = ConfigDict(extra="forbid")

    interrupt_id: str = Field(min_length=1, max_length=MAX_INTERRUPT_ID_LENGTH,
                              description="From the snapshot's pending_interrupts.")
    approved: bool = Field(description="true runs the call; false rejects it.")
    rejection_message: str | None = Field(
        default=None, max_length=MAX_REJECTION_MESSAGE_LENGTH,
        description="When rejecting: what the model is told. Ignored when approving.",
    )
    session_id: str | None = Field(
        default=None, min_length=1, max_length=MAX_SESSION_ID_LENGTH,
        description="Optional: must equal the token's session. Required with an operator "
                    "(--all-sessions) token.",
    )
    arguments: dict[str, Any] | None = Field(
        default=None,
        description="When approving: run the tool with these arguments instead of the "
                    "model's (checked against the tool's schema; 400 naming the field "
                    "otherwise). Both versions are recorded and the model is told.",
    )
    arguments_version: str | None = Field(
        default=None, min_length=1, max_length=MAX_INTERRUPT_ID_LENGTH,
        description="When approving: the pending interrupt's arguments_version the approver "
                    "saw. An approval of a version edited meanwhile is refused (409, saying "
                    "the arguments changed); one that names no version approves the model's "
                    "arguments only while no one edited them.",
    )


class BodyError(ValueError):
    """A resolve body that cannot be used; the message is the ``error`` text of the 400."""


@dataclass(frozen=True)
class ResolveBody:
    """A resolve body that passed :func:`parse_resolve_body`."""

    interrupt_id: str
    approved: bool
    rejection_message: str | None
    session_id: str | None
    arguments: dict[str, Any] | None = None
    arguments_version: str | None = None


def parse_resolve_body(raw: bytes) -> ResolveBody:
    """The decision in ``raw``, or :class:`BodyError` naming what is wrong.

    Fields are checked in the seeds' order (interrupt_id, approved, rejection_message), so a
    body with several faults gets the same text it would get from the seeds' route.
    """
    try:
        body: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise BodyError(f"the body must be a JSON object; it is not valid JSON ({err})") from None
    except RecursionError:
        raise BodyError("the body must be a JSON object; it is nested too deeply") from None
    if not isinstance(body, dict):
        raise BodyError(f"the body must be a JSON object, got a JSON {_json_kind(body)}")
    interrupt_id = body.get("interrupt_id")
    if not isinstance(interrupt_id, str) or not interrupt_id:
        raise BodyError(INTERRUPT_ID_ERROR)
    _check_text("interrupt_id", interrupt_id, MAX_INTERRUPT_ID_LENGTH)
    approved = body.get("approved")
    if not isinstance(approved, bool):
        raise BodyError(APPROVED_ERROR)
    rejection_message = body.get("rejection_message")
    if rejection_message is not None and not isinstance(rejection_message, str):
        raise BodyError(REJECTION_MESSAGE_ERROR)
    if rejection_message is not None:
        _check_text("rejection_message", rejection_message, MAX_REJECTION_MESSAGE_LENGTH)
    session_id = body.get("session_id")
    if session_id is not None:
        if not isinstance(session_id, str) or not session_id:
            raise BodyError("session_id must be a non-empty string when given")
        _check_text("session_id", session_id, MAX_SESSION_ID_LENGTH)
    arguments = body.get("arguments")
    if arguments is not None and not isinstance(arguments, dict):
        raise BodyError("arguments must be a JSON object when given")
    if arguments is not None and not approved:
        raise BodyError("arguments can only be given when approving")
    version = body.get("arguments_version")
    if version is not None:
        if not isinstance(version, str) or not version:
            raise BodyError("arguments_version must be a non-empty string when given")
        _check_text("arguments_version", version, MAX_INTERRUPT_ID_LENGTH)
    unknown = sorted(set(body) - set(ResolveRequest.model_fields))
    if unknown:
        raise BodyError(f"unknown field {unknown[0]!r} (the body takes "
                        f"{', '.join(ResolveRequest.model_fields)})")
    return ResolveBody(interrupt_id, approved, rejection_message, session_id, arguments, version)


def _check_text(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise BodyError(f"{field} must be at most {limit} characters, got {len(value)}")
    # JSON lets a body carry NUL and lone surrogates; neither can be stored or compared
    # reliably (PostgreSQL refuses NUL, UTF-8 cannot encode a lone surrogate).
    problem = text_problem(value)
    if problem:
        raise BodyError(f"{field} {problem}")


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


class ResolveResponse(BaseModel):
    """Whether this request made the decision."""

    accepted: bool = Field(
        description="true if this request decided; false if the interrupt was already decided, "
        "its deadline passed, or it does not exist in that session. Safe to retry."
    )
    reason: Literal["already_decided", "deadline_passed", "unknown_interrupt"] | None = Field(
        default=None,
        description="Why not, when accepted is false: already_decided (by a person or the "
        "deadline sweep), deadline_passed (the sweep has not rejected it yet), or "
        "unknown_interrupt (no such interrupt in the token's session); null when accepted.",
    )


class ErrorResponse(BaseModel):
    """A request the API cannot use (400, 413): ``error`` says what is wrong and names the
    field."""

    error: str


class ValidationErrorItem(BaseModel):
    """One problem with a request's parameters, located by ``loc``."""

    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorResponse(BaseModel):
    """A 400 for a path, query or header parameter: ``error`` names every bad field in one
    line; ``detail`` has one item per field."""

    error: str
    detail: list[ValidationErrorItem]


class DetailResponse(BaseModel):
    """401, 403, 404, 405 and 503: ``error`` says why (and, for 401/403, what to ask for);
    ``detail`` is the same text, FastAPI's own key."""

    error: str
    detail: str


class HealthResponse(BaseModel):
    """Liveness, and whether the store and Redis answer and beat sweeps."""

    status: Literal["ok", "unavailable"]
    store: Literal["ok"]
    redis: Literal["ok", "unreachable"]
    beat: Literal["ok", "late", "unknown"] = Field(
        description="ok: a sweep ran within 3 sweep intervals; late: none did (no beat is "
        "running: approval deadlines are not enforced); unknown: Redis does not answer.")
    event_streams: int = Field(description="Event-stream connections open right now.")
    error: str | None = Field(default=None, description="What does not answer (503 only).")


class PendingSession(BaseModel):
    """A session with approvals waiting for a decision."""

    session_id: str
    pending: int = Field(description="How many of its approvals wait (deadline not passed).")
    newest_request_at: datetime = Field(description="When its latest waiting call was made.")
    oldest_request_at: datetime = Field(description="When its earliest waiting call was made.")
    next_deadline: datetime | None = Field(
        description="The earliest deadline among its waiting approvals (none if none has one).")
    page: str = Field(description="The session page's path (add the token as ?token=).")


class PendingSessions(BaseModel):
    """The sessions with approvals waiting, newest request first."""

    sessions: list[PendingSession]
    truncated: bool = Field(description="true if more sessions wait than `limit` returned.")


def validation_error_body(exc: RequestValidationError) -> dict[str, Any]:
    """The 400 body for bad parameters: a readable ``error`` naming the fields, plus FastAPI's
    ``detail`` items.

    The submitted values are not echoed back.
    """
    items: list[dict[str, Any]] = []
    parts: list[str] = []
    for error in exc.errors():
        loc = [p if isinstance(p, int) else str(p) for p in error.get("loc", ())]
        # ("query", "limit") -> "limit"; ("path", "session_id") -> "session_id".
        where = ".".join(str(p) for p in loc[1:]) if len(loc) > 1 else ".".join(map(str, loc))
        msg = str(error.get("msg", "invalid"))
        items.append({"loc": loc, "msg": msg, "type": str(error.get("type", "invalid"))})
        parts.append(f"{where or 'request'}: {msg}")
    return {"error": "invalid request: " + "; ".join(parts), "detail": items}


class SnapshotPage(AgentSnapshot):
    """A bounded part of a session (``GET /sessions/{id}/snapshot``): at most ``limit`` items
    in each list. Page on with the cursors: the last message's ``id`` as ``messages_after``,
    the last call's ``key`` as ``calls_after``; the ``*_more`` fields say whether there is
    more to read in that direction."""

    limit: int = Field(description="The most items any list of this page holds.")
    messages_more: bool = Field(
        description="More messages after this page (before it, with `messages_before`).")
    calls_more: bool = Field(description="More calls after this page's last one.")
    pending_more: bool = Field(description="More approvals wait than `pending_interrupts` "
                                           "holds (the oldest are listed).")
    decided_more: bool = Field(description="Older decisions than `decided` holds (the newest "
                                           "are listed).")
    beat: Literal["ok", "late", "unknown"] = Field(
        "unknown", description="Whether a beat swept within 3 sweep intervals, as `/healthz` "
                               "says: `late` means approval deadlines are not being enforced "
                               "(the session page shows a warning); `unknown`, Redis did not "
                               "answer.")
    event_cursor: int = Field(
        description="The session's latest event id before this was read: "
                    "`/events?after=<event_cursor>` follows the session from here on, "
                    "missing nothing.")
