"""The ``dex-tasks`` commands of the store: the ``db`` group (schema revision, migrations)
and ``prune``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

import typer

from dex_tasks.settings import DexSettings
from dex_tasks.store import Store

commands = typer.Typer()


db_app = typer.Typer(help="The store's schema: its revision, and the migrations to head.",
                     no_args_is_help=True)
commands.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Migrate DEX_DATABASE_URL's schema to this release's (head), in one transaction.

    Stop the processes of the older release first: they were written for the old schema. A
    store made by a release before migrations is recognised and upgraded too.
    """
    from dex_tasks.store.schema import upgrade

    store = Store(DexSettings().database_url)
    try:
        before, after = upgrade(store)
    finally:
        store.close()
    if before.revision == after.revision:
        typer.echo(f"{after.url}: already at head {after.head}")
    else:
        typer.echo(f"{after.url}: upgraded from {before.revision or before.state} to head "
                   f"{after.revision}")


@db_app.command("current")
def db_current() -> None:
    """Print DEX_DATABASE_URL's schema revision and whether it is head (exit status 0 at
    head, 1 otherwise)."""
    from dex_tasks.store.schema import UPGRADE_COMMAND, inspect_schema

    store = Store(DexSettings().database_url)
    try:
        status = inspect_schema(store)
    finally:
        store.close()
    state = status.state
    if state == "head":
        typer.echo(f"{status.url}: {status.revision} (head)")
        return
    if state == "empty":
        line = (f"no schema yet (an empty database: the first worker, beat, API or client to "
                f"start migrates it to head {status.head}, or run `{UPGRADE_COMMAND}`)")
    elif state == "unversioned":
        line = (f"no revision recorded (tables of a release before migrations; head is "
                f"{status.head}): run `{UPGRADE_COMMAND}`")
    elif state == "behind":
        line = f"{status.revision} (behind head {status.head}): run `{UPGRADE_COMMAND}`"
    else:
        line = (f"{status.revision} (not a revision this dex-tasks knows; its head is "
                f"{status.head}): a newer release migrated it")
    typer.echo(f"{status.url}: {line}")
    raise typer.Exit(1)


def _check_age(value: str) -> str:
    """Refuse a bad --older-than before anything connects (typer names the option)."""
    from dex_tasks.errors import InvalidArgumentError
    from dex_tasks.store.prune import AGE_RULE, parse_age

    try:
        parse_age(value)
    except InvalidArgumentError:
        raise typer.BadParameter(f"{AGE_RULE}; got {value!r}") from None
    return value


@commands.command()
def prune(
    older_than: str = typer.Option(
        ..., "--older-than",
        help="How long ago a call must have finished: 30d, 12h or 90m (days, hours, minutes).",
        callback=_check_age,
    ),
    batch: int | None = typer.Option(
        None, "--batch", min=1,
        help="Calls (or messages) deleted per transaction [default: DEX_PRUNE_BATCH, 1000].",
    ),
) -> None:
    """Delete finished calls older than --older-than, with their events, interrupts and
    transcript messages, in short transactions (workers keep running).

    Also ended turns, and the LangGraph checkpoints of threads whose session has nothing open
    (an idle thread whole; a thread in use down to its latest checkpoints).

    Kept: outcome_unknown calls no user message has reported yet, calls whose turn is still
    open, and the messages of sessions with a call or a turn still open.
    """
    from dex_tasks.store.prune import parse_age
    from dex_tasks.store.prune import prune as run_prune

    seconds = parse_age(older_than)
    settings = DexSettings()
    store = Store(settings.database_url)
    try:
        store.create_all()
        result = run_prune(store, seconds, batch=batch or settings.prune_batch,
                           on_pruned=forget_claims(settings))
    finally:
        store.close()
    typer.echo(
        f"deleted {result.calls} calls finished before "
        f"{datetime.fromtimestamp(result.cutoff, tz=UTC):%Y-%m-%d %H:%M:%S} UTC "
        f"({result.events} events, {result.interrupts} interrupts, {result.tool_messages} tool "
        f"messages), {result.messages} user and assistant messages, {result.turns} ended "
        f"turns and {result.checkpoints} LangGraph checkpoints ({result.checkpoint_writes} "
        f"writes), in {result.batches} transactions (the longest "
        f"{result.longest_batch_seconds * 1000:.0f} ms)")
    if result.kept_unreported or result.kept_open_turn:
        typer.echo(f"kept {result.kept_unreported} outcome_unknown calls not yet reported and "
                   f"{result.kept_open_turn} calls of turns still open")


def forget_claims(settings: DexSettings) -> Callable[[list[str]], None]:
    """What prune does with the keys of the single-attempt calls it deleted: delete their Redis
    claims (best effort: unreachable Redis only keeps them until their TTL; the tombstones
    in the store are what keeps a replay from running)."""
    from dex_tasks.broker.redis_clients import redis_client
    from dex_tasks.worker import claims

    client = redis_client(settings, socket_timeout=5)

    def forget(keys: list[str]) -> None:
        try:
            claims.forget(client, keys)
        except Exception as err:  # noqa: BLE001 - the claims expire on their own
            logging.getLogger("dex_tasks").warning(
                "could not delete the Redis claims of pruned calls: %s", err,
                extra={"action": "prune_claims_error", "count": len(keys)})

    return forget
