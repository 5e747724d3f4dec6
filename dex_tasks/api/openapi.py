"""What the API's OpenAPI document says beyond what FastAPI infers: every status a route can
answer, with its body's schema, and the resolve route's body (which the route reads itself,
after the token check, so FastAPI does not see it)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dex_tasks.api.limits import MAX_BODY_BYTES
from dex_tasks.api.schemas import (
    DetailResponse,
    ErrorResponse,
    ResolveRequest,
    ValidationErrorResponse,
)

AUTH_401: dict[str, Any] = {
    "description": "No token, or a malformed, forged or expired one.", "model": DetailResponse}
AUTH_403: dict[str, Any] = {
    "description": "A genuine token for another session, or without the permission this route "
                   "needs.", "model": DetailResponse}
PARAMS_400: dict[str, Any] = {
    "description": "A bad path, query or header parameter; `error` names it.",
    "model": ValidationErrorResponse}
PAGE_400: dict[str, Any] = {
    "description": "A bad path or query parameter: an HTML page naming it (a person opened "
                   "this link).", "content": {"text/html": {"schema": {"type": "string"}}}}
BODY_413: dict[str, Any] = {
    "description": f"The request body is over {MAX_BODY_BYTES} bytes; it is not read.",
    "model": ErrorResponse}
STORE_503: dict[str, Any] = {
    "description": "The store is unreachable; retry (see Retry-After).", "model": DetailResponse}
SESSION_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: PARAMS_400, 401: AUTH_401, 403: AUTH_403, 413: BODY_413, 503: STORE_503}

RESOLVE_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "The body cannot be used. `error` is one of the seeds' texts "
                         "(`interrupt_id must be a non-empty string`, `approved must be a "
                         "boolean`, `rejection_message must be a string`) or names what else is "
                         "wrong (not JSON, not an object, an unknown field, a value too long, "
                         "no session_id with an operator token).",
          "model": ErrorResponse},
    401: {**AUTH_401, "description": AUTH_401["description"] + " Checked before the body is read."},
    403: {**AUTH_403, "description": "A genuine token without the `operate` permission "
                                     "(checked before the body is read), or a body "
                                     "`session_id` that is not the token's session."},
    409: {"description": "An approval of a version of the arguments (`arguments_version`) "
                         "that another approver's edit replaced, or one that names no version "
                         "after an edit: `error` says the arguments changed and shows the "
                         "current ones. Nothing changed.",
          "model": ErrorResponse},
    413: BODY_413,
    503: STORE_503,
}
# The body is read by the route itself (after the token check), so FastAPI does not know it:
# document it here.
RESOLVE_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/ResolveRequest"}}}}}


def openapi_schema(api: FastAPI) -> dict[str, Any]:
    """The schema FastAPI generates, corrected where our routes answer differently: bad
    parameters are 400 (not FastAPI's 422), and the resolve body is documented."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, summary=api.summary,
                             routes=api.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        components["ResolveRequest"] = ResolveRequest.model_json_schema(
            ref_template="#/components/schemas/{model}")
        api.openapi_schema = schema
    return api.openapi_schema
