"""Request and response bodies of the HTTP API (its OpenAPI schema comes from these)."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field


class ResolveRequest(BaseModel):
    """A person's decision on one pending approval."""

    # strict: "approved": "yes" or 1 is a client bug, not a decision; forbid: a misspelt
    # "rejection_mesage" must not silently drop the message the model was meant to read.
    model_config = ConfigDict(strict=True, extra="forbid")

    session_id: str = Field(min_length=1, max_length=200, description="The call's session.")
    interrupt_id: str = Field(min_length=1, max_length=64,
                              description="From the snapshot's pending_interrupts.")
    approved: bool = Field(description="true runs the call; false rejects it.")
    rejection_message: str | None = Field(
        default=None, max_length=4000,
        description="When rejecting: what the model is told. Ignored when approving.",
    )


class ResolveResponse(BaseModel):
    """Whether this request made the decision."""

    accepted: bool = Field(
        description="true if this request decided; false if the interrupt was already decided, "
        "its deadline passed, or it does not exist in that session. Safe to retry."
    )


class HealthResponse(BaseModel):
    """Liveness and store reachability."""

    status: str
    store: str
    event_streams: int = Field(description="Event-stream connections open right now.")


class ValidationErrorItem(BaseModel):
    """One problem with a request, located by ``loc``."""

    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorResponse(BaseModel):
    """A 422: ``message`` names every bad field in one line; ``detail`` has one item per field."""

    message: str
    detail: list[ValidationErrorItem]


def validation_error_body(exc: RequestValidationError) -> dict[str, Any]:
    """The 422 body: a readable ``message`` naming the fields, plus FastAPI's ``detail`` items.

    The submitted values are not echoed back: a rejection message is free text a person typed.
    """
    items: list[dict[str, Any]] = []
    parts: list[str] = []
    for error in exc.errors():
        loc = [p if isinstance(p, int) else str(p) for p in error.get("loc", ())]
        # ("body", "approved") -> "approved"; ("query", "after") -> "after"; the body itself
        # (not a JSON object, not JSON at all) -> "body".
        where = ".".join(str(p) for p in loc[1:]) if len(loc) > 1 else ".".join(map(str, loc))
        msg = str(error.get("msg", "invalid"))
        if error.get("type") == "json_invalid":
            # loc is ("body", <character position>): the body as a whole is not JSON.
            where, msg = "body", f"not valid JSON ({msg} at character {loc[-1]})"
        items.append({"loc": loc, "msg": msg, "type": str(error.get("type", "invalid"))})
        parts.append(f"{where or 'request'}: {msg}")
    return {"message": "invalid request: " + "; ".join(parts), "detail": items}
