"""The run context of a dex run (its session and turn) and the client forms the adapter takes."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, MutableMapping
from typing import Any

from dex_tasks import AsyncDexClient, DexClient, InvalidCallError, key_part


def dex_context(session_id: str, turn_id: str | None = None, *,
                client: DexClient | AsyncDexClient | None = None) -> dict[str, str]:
    """The run context that names the dex session and turn of one ``Runner.run``.

    With ``client``: the session's open turn when it has one (the agent process was restarted
    mid-turn: running the same ``Runner.run`` with :func:`dex_run_config` continues it), else
    no ``turn_id``, which :func:`dex_run_config` gives the run when it begins the turn. Without
    ``client``, ``turn_id`` defaults to a new random id (for runs without
    :func:`dex_run_config`). A plain dict because ``RunState.to_string``/``from_string``
    restore a mapping context as it was. Your own context works as well if it has
    ``session_id`` and ``turn_id`` (keys or attributes).
    """
    if turn_id is not None:
        return {"session_id": session_id, "turn_id": turn_id}
    if client is None:
        return {"session_id": session_id, "turn_id": uuid.uuid4().hex}
    open_turn = sync_client(client).open_turn(session_id)
    if open_turn is None:
        return {"session_id": session_id}
    return {"session_id": session_id, "turn_id": open_turn.turn_id}


# -- keys -------------------------------------------------------------------------------------


def call_ids(context: Any, call_id: str) -> tuple[str, str, str]:
    """(session_id, turn_id, tool_call_id) of a call, from the run context and the call id."""
    ids = []
    for field in ("session_id", "turn_id"):
        value = context.get(field) if isinstance(context, Mapping) else getattr(
            context, field, None)
        if not isinstance(value, str) or not value:
            raise InvalidCallError(
                f"the run context has no {field}: pass context=dex_context(session_id) to "
                f"Runner.run (or a context with session_id and turn_id), got {context!r}"
            )
        ids.append(value)
    return ids[0], ids[1], key_part(call_id)


# -- the paused run -----------------------------------------------------------------------------


def async_client(client: DexClient | AsyncDexClient) -> AsyncDexClient:
    if isinstance(client, AsyncDexClient):
        return client
    if isinstance(client, DexClient):
        return AsyncDexClient(client=client)
    raise TypeError(f"client must be a DexClient or AsyncDexClient, got {type(client).__name__}")


def sync_client(client: DexClient | AsyncDexClient) -> DexClient:
    return async_client(client).sync


def get_field(context: Any, field: str) -> Any:
    return context.get(field) if isinstance(context, Mapping) else getattr(context, field, None)


def put_field(context: Any, field: str, value: Any) -> None:
    if isinstance(context, MutableMapping):
        context[field] = value
    else:
        setattr(context, field, value)


def required_field(context: Any, field: str) -> str:
    value = get_field(context, field)
    if not isinstance(value, str) or not value:
        raise InvalidCallError(
            f"the run context has no {field}: pass context=dex_context(session_id, "
            f"client=client) to Runner.run, got {context!r}")
    return value
