"""The ``dex-tasks`` commands of approvals: ``token`` (signed access for the API and the
page) and the ``approvals`` group (list, approve, reject)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import typer

from dex_tasks.logs import visible
from dex_tasks.ops.cli_common import console, positive_seconds
from dex_tasks.ops.cli_render import print_json
from dex_tasks.settings import DexSettings
from dex_tasks.store import Store

commands = typer.Typer()


@commands.command()
def token(
    session_id: str | None = typer.Argument(
        None, help="The session the token is for (omit with --all-sessions)."),
    all_sessions: bool = typer.Option(
        False, "--all-sessions",
        help="An operator token, valid for every session, which also opens GET /sessions "
             "(the sessions waiting for a decision).",
    ),
    permission: Literal["view", "operate", "call"] = typer.Option(
        "operate", "--permission",
        help="operate: read and decide approvals (a person's token); view: read only (the "
             "page shows no Approve/Reject); call: call tools through dex-tasks mcp --http "
             "and nothing else (an MCP client's token: it cannot decide approvals).",
    ),
    ttl: float = typer.Option(3600.0, "--ttl", help="Seconds until the token expires.",
                              callback=positive_seconds),
    approver: str | None = typer.Option(
        None, "--approver", help="The name recorded with each decision made with the token."
    ),
    grant: Annotated[list[str] | None, typer.Option(
        "--grant",
        help="A named permission the token also carries (a policy's approver_permission, "
             "e.g. refunds.approve); repeat for several.")] = None,
) -> None:
    """Print a token, signed with DEX_SECRET_KEY, for the HTTP API and the session page.

    Open the page at /sessions/SESSION_ID?token=TOKEN (an operator token: /sessions?token=TOKEN).
    An MCP client gets its own token, --permission call, never a person's operate token.
    """
    from dex_tasks.errors import DexError
    from dex_tasks.tokens import issue_token

    if all_sessions == (session_id is not None):
        raise typer.BadParameter("give a SESSION_ID or --all-sessions (exactly one)")
    settings = DexSettings()
    try:
        secret = settings.signing_key()
    except DexError as err:
        typer.echo(f"error: {visible(str(err))}", err=True)
        raise typer.Exit(2) from None
    try:
        typer.echo(issue_token(secret, session_id, ttl, approver,
                               permissions=(permission, *(grant or ())),
                               all_sessions=all_sessions))
    except DexError as err:
        raise typer.BadParameter(str(err)) from None


approvals_app = typer.Typer(help="List, approve and reject tool calls waiting for a person.",
                            no_args_is_help=True)
commands.add_typer(approvals_app, name="approvals")


def _cli_approver() -> str:
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no login name (a container): still say it was the CLI
        return "cli"


@approvals_app.command("list")
def approvals_list(
    session_id: str | None = typer.Argument(None, help="Only this session (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the calls waiting for approval, oldest first."""
    from dex_tasks.agent.approvals import list_pending

    store = Store(DexSettings().database_url)
    store.create_all()
    pending = list_pending(store, session_id)
    if as_json:
        print_json(console, json.dumps([p.model_dump(mode="json") for p in pending]))
        return
    from dex_tasks.ops.cli_render import approvals_view

    console.print(approvals_view(pending), highlight=False)


def _decide(session_id: str, interrupt_id: str, approved: bool, message: str | None,
            approver: str | None, arguments: str | None = None,
            permissions: list[str] | None = None, version: str | None = None) -> None:
    from dex_tasks.agent.approvals import (
        ALREADY_DECIDED,
        DEADLINE_PASSED,
        UNKNOWN_INTERRUPT,
        WRONG_SESSION,
        get_interrupt,
    )
    from dex_tasks.agent.client import DexClient
    from dex_tasks.errors import DexError

    edited = None
    if arguments is not None:
        try:
            edited = json.loads(arguments)
        except ValueError as err:
            raise typer.BadParameter(f"--arguments is not JSON: {err}") from None
    with DexClient(DexSettings()) as client:
        who = approver or _cli_approver()
        try:
            decided = client.resolve_interrupt(session_id, interrupt_id, approved,
                                               rejection_message=message, approver=who,
                                               arguments=edited, permissions=permissions,
                                               arguments_version=version)
        except DexError as err:
            typer.echo(f"not decided: {err}", err=True)
            raise typer.Exit(2) from None
        if decided:
            row = get_interrupt(client.store, interrupt_id)
            call = client.get_tool_call(row.key) if row else None
            status = call.status.value if call else "?"
            if row is not None and row.decision is None:
                typer.echo(visible(f"approval counted: {row.approvals_given} of "
                                   f"{row.approvals_required} for interrupt {interrupt_id} "
                                   f"as {who}"))
                if edited is not None and call is not None and call.arguments_edit:
                    typer.echo(visible(f"{call.arguments_edit}; the approvals start again "
                                       "on the edited arguments"))
                return
            typer.echo(visible(f"decided: {'approved' if approved else 'rejected'} interrupt "
                               f"{interrupt_id} as {who}; call {call.key if call else '?'} is "
                               f"{status}"))
            if call is not None and call.arguments_edit:
                typer.echo(visible(call.arguments_edit))
            return
        reason = client.why_not_resolved(session_id, interrupt_id)
        row = get_interrupt(client.store, interrupt_id)
        if reason in (UNKNOWN_INTERRUPT, WRONG_SESSION) or row is None:
            why = f"session {session_id!r} has no interrupt {interrupt_id!r}"
        elif reason == ALREADY_DECIDED:
            by = row.decided_by or ("the deadline sweep" if row.decision == "expired" else "?")
            why = f"it was already {row.decision} by {by}"
        elif reason == DEADLINE_PASSED:
            why = "its approval deadline has passed"
        else:
            why = "it could not be decided (see the logs)"
        why = f"{why} ({reason or 'unknown'})"
        typer.echo(visible(f"not decided: {why}"), err=True)
        raise typer.Exit(1)


@approvals_app.command("approve")
def approvals_approve(
    session_id: str = typer.Argument(..., help="The call's session."),
    interrupt_id: str = typer.Argument(..., help="From `dex-tasks approvals list`."),
    approver: str | None = typer.Option(None, "--approver",
                                        help="Recorded as who decided (default: cli:$USER)."),
    arguments: str | None = typer.Option(
        None, "--arguments",
        help="Approve with these arguments instead (a JSON object, checked against the "
             "tool's schema); the call records both versions."),
    permission: Annotated[list[str] | None, typer.Option(
        "--permission",
        help="A permission the approver holds (for a policy with approver_permission).")] = None,
    version: str | None = typer.Option(
        None, "--arguments-version",
        help="The arguments_version you saw (`approvals list --json`): refused, changing "
             "nothing, if another approver edited the arguments since."),
) -> None:
    """Approve a waiting call: it runs. Exit status 1 if this did not decide it (2 if the
    arguments, their version or the permission were refused)."""
    _decide(session_id, interrupt_id, True, None, approver, arguments, permission, version)


@approvals_app.command("reject")
def approvals_reject(
    session_id: str = typer.Argument(..., help="The call's session."),
    interrupt_id: str = typer.Argument(..., help="From `dex-tasks approvals list`."),
    message: str | None = typer.Option(None, "--message", "-m",
                                       help="Why; the model reads it in the call's error."),
    approver: str | None = typer.Option(None, "--approver",
                                        help="Recorded as who decided (default: cli:$USER)."),
) -> None:
    """Reject a waiting call: it never runs. Exit status 1 if this did not decide it."""
    _decide(session_id, interrupt_id, False, message, approver)
