"""How the ``dex-tasks`` command shows calls and approvals in a terminal.

Readable at 80 columns: what an operator copies into the next command (a call's key, an
interrupt id, a session) is never cut or wrapped; long free text (errors, arguments) goes on
lines of its own, where the terminal wraps it, instead of a column squeezed to a few letters.
Unicode is printed as text, never as ``\\u`` escapes.

Ids, tool names, arguments and error texts come from agents, tools and remote servers: every one
goes out through :func:`user_text` (or :func:`print_json`), which shows control and bidi
characters as escapes (a terminal would run ``ESC [2J`` or an OSC 52 clipboard write) and never
reads them as rich markup.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.highlighter import JSONHighlighter
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

from dex_tasks.logs import json_visible, visible
from dex_tasks.store.records import PendingInterrupt, ToolCallRecord

WIDE = 110
"""From this console width on, the calls table also shows each call's effect class."""

ERROR_CHARS = 300
ARGUMENT_CHARS = 400


def user_text(value: object, style: str = "") -> Text:
    """Data from outside as a rich ``Text``: controls and bidi characters escaped, no markup."""
    return Text(visible(str(value)), style=style)


def user_markup(value: object) -> str:
    """Data from outside, safe inside a rich markup string (``f"[red]x[/red] {...}"``)."""
    return escape(visible(str(value)))


def print_json(console: Console, data: str) -> None:
    """Print serialized JSON, indented and highlighted like ``console.print_json``, with
    control and bidi characters as ``\\u`` escapes (the same JSON value)."""
    text = json.dumps(json.loads(data), indent=2, ensure_ascii=False)
    console.print(JSONHighlighter()(json_visible(text)), soft_wrap=True)


def calls_view(calls: Sequence[ToolCallRecord], console: Console) -> RenderableType:
    """A session's calls: a table row each (a block each where a row would not fit), then
    the errors of those that have one."""
    if not calls:
        return Text("no tool calls")
    wide = console.width >= WIDE
    table = Table(
        Column("key", no_wrap=True),
        Column("tool", no_wrap=True),
        *([Column("effect", no_wrap=True)] if wide else []),
        Column("status", no_wrap=True),
        Column("tries", no_wrap=True, justify="right"),
        # Two spaces between columns and none at the edges: a typical key, tool and status
        # fit 80 columns side by side.
        box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1),
    )
    for call in calls:
        table.add_row(user_text(call.key), user_text(call.tool),
                      *([call.effect.value] if wide else []), call.status.value, _tries(call))
    errors: list[Text] = []
    for call in calls:
        if call.error:
            line = user_text(f"{call.key}: ", style="bold")
            line.append(visible(_clip(call.error, ERROR_CHARS)))
            errors.append(line)
    natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if natural > console.width:
        # Too narrow for a row per call: rather than cut a key or a tool name, give each
        # call two lines.
        blocks: list[RenderableType] = []
        for call in calls:
            blocks.append(user_text(call.key, style="bold"))
            blocks.append(user_text(f"  {call.tool}  {call.status.value}  tries {_tries(call)}"))
        return Group(*blocks, *([Text("")] if errors else []), *errors)
    return Group(table, *errors) if errors else table


def _tries(call: ToolCallRecord) -> str:
    return f"{call.attempts}/{call.max_attempts}"


def approvals_view(pending: Iterable[PendingInterrupt]) -> RenderableType:
    """Calls waiting for a person, one block each: everything needed to decide, and the
    command that approves it."""
    blocks: list[RenderableType] = []
    for p in pending:
        grid = Table.grid(padding=(0, 2), pad_edge=True)
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(overflow="fold")
        grid.add_row("call", user_text(p.key))
        grid.add_row("tool", user_text(f"{p.tool} ({p.effect.value})"))
        grid.add_row("arguments", user_text(_clip(json_visible(
            json.dumps(p.arguments, ensure_ascii=False)), ARGUMENT_CHARS)))
        grid.add_row("deadline", p.deadline.strftime("%Y-%m-%d %H:%M:%S UTC")
                     if p.deadline else "none")
        if p.approvals_required > 1:
            so_far = ", ".join(p.approved_by) or "nobody yet"
            needs = f" holding {p.approver_permission}" if p.approver_permission else ""
            grid.add_row("approvals", f"{len(p.approved_by)} of {p.approvals_required}{needs} "
                                      f"(so far: {so_far})")
        title = Text("interrupt ", style="bold")
        title.append(visible(p.interrupt_id))
        title.append(visible(f"  session {p.session_id}"))
        # The command to copy, on one line even if the terminal must wrap it (reject: the same
        # with `reject` and an optional -m MESSAGE).
        command = Text(visible(f"  dex-tasks approvals approve {p.session_id} "
                               f"{p.interrupt_id}"), no_wrap=True, overflow="ignore")
        blocks += [title, grid, command, Text("")]
    if not blocks:
        return Text("no calls are waiting for approval")
    return Group(*blocks[:-1])


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def webhooks_view(rows: Sequence[dict[str, Any]]) -> RenderableType:
    """Webhook deliveries: one row each, with its attempts and last error."""
    if not rows:
        return Text("no webhook deliveries")
    table = Table("created (UTC)", "event", "event id", "url", "status", "attempts",
                  Column("last error", overflow="fold"), box=box.SIMPLE)
    for r in rows:
        created = datetime.fromtimestamp(r["created_at"], tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(created, r["event"], r["event_id"], r["url"], r["status"],
                      str(r["attempts"]), _clip(r["last_error"] or "", 120))
    return table
