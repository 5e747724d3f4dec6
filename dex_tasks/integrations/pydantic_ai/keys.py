"""Idempotency keys of a Pydantic AI run's calls, from what its message history keeps."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic_ai import ModelMessage, ModelResponse

from dex_tasks import DexError, ToolCallRecord, key_part

# Ids dex-tasks accepts (dex_tasks/limits.py): at most 200 characters, no "/".
_ID_MAX = 200
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# -- ids ----------------------------------------------------------------------------------------


def fit_id(value: str) -> str:
    """The dex id for a framework id: ``dex_tasks.key_part``, one-to-one."""
    return key_part(value)


def _turn_id(response: ModelResponse) -> str:
    """The id of the model response that holds a call (see the module docstring)."""
    if response.provider_response_id:
        return fit_id(response.provider_response_id)
    stamp = response.timestamp
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    # Whole microseconds since the epoch: exact, and the same after a JSON round trip of the
    # history (an ISO string's offset notation could differ between writer and reader).
    micros = (stamp - _EPOCH) // timedelta(microseconds=1)
    calls = [[part.tool_name, part.tool_call_id] for part in response.tool_calls]
    digest = hashlib.sha256(json.dumps([micros, calls]).encode()).hexdigest()[:24]
    return f"response-{digest}"


def holding_response(messages: Sequence[ModelMessage], tool_call_id: str) -> ModelResponse:
    # The latest response that made the call: a model that reuses tool-call ids made the earlier
    # ones in earlier responses, and the calls being run belong to the latest.
    for message in reversed(messages):
        if isinstance(message, ModelResponse) and any(
            part.tool_call_id == tool_call_id for part in message.tool_calls
        ):
            return message
    raise DexError(f"tool call {tool_call_id!r} is in no model response of the run's messages, "
                   "so its idempotency key cannot be built")


def call_key(session_id: str | None, response: ModelResponse, tool_call_id: str,
              conversation_id: str | None = None) -> tuple[str, str, str]:
    session = session_id or response.conversation_id or conversation_id
    if not session:
        raise DexError("the model response has no conversation id and no session_id was given, "
                       "so the call has no session: pass DexCapability(session_id=...)")
    return fit_id(session), _turn_id(response), fit_id(tool_call_id)


def deferred_metadata(record: ToolCallRecord) -> dict[str, Any]:
    """What a deferred call carries in ``DeferredToolRequests.metadata``."""
    return {"dex_key": record.key, "dex_session_id": record.session_id,
            "dex_interrupt_id": record.interrupt_id, "dex_tool": record.tool}
