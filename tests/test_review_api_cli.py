"""The ``dex-tasks`` command never hands a terminal raw control characters from user data:
ids, tool arguments and error texts with ESC sequences (clear screen, an OSC 52 clipboard
write) or bidi controls are printed as visible escapes, in tables and in ``--json`` alike,
and never read as rich markup (issue 19, finding 11)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.ops.cli import app
from tests.conftest import settings_env
from workers import example_tools

assert example_tools.refund_payment  # registered here: call_tool validates locally

runner = CliRunner()
SESSION = "sess-escapes"
CLEAR = "\x1b[2J\x1b[H"
CLIPBOARD = "\x1b]52;c;ZWNobyBvd25lZA==\x07"  # OSC 52: put "echo owned" on the clipboard
C1_CSI = "\x9b2J"  # the 8-bit CSI: a terminal in 8-bit mode clears the screen too
BIDI = "\u202e00001 :tnuoma"  # shows as "amount: 10000"
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


@pytest.fixture
def escaped_session(settings: DexSettings, client: DexClient,
                    monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in settings_env(settings).items():
        if name.startswith("DEX_"):
            monkeypatch.setenv(name, value)
    queued = client.call_tool(session_id=SESSION, turn_id="t1",
                              tool_call_id=f"c1{CLEAR}[bold]x", tool="lookup_order",
                              arguments={"order_id": "1001"})
    # A tool's (or an MCP server's) error text, stored by the guarded transition as a worker
    # would.
    assert client.store.transition(
        queued.key, CallStatus.FAILED, allowed={CallStatus.QUEUED},
        values={"error": f"boom {CLIPBOARD} {C1_CSI} {BIDI}"})
    waiting = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c2",
                               tool="refund_payment",
                               arguments={"charge_id": f"ch_{BIDI}{CLEAR}", "amount_cents": 1})
    assert waiting.status is CallStatus.AWAITING_APPROVAL
    return {"failed": queued.key, "waiting": waiting.key}


def _assert_no_raw_controls(output: str) -> None:
    leaked = [c for c in RAW if c in output]
    assert not leaked, f"raw control characters {leaked!r} in:\n{output!r}"


def test_calls_and_approvals_print_controls_as_escapes(
    escaped_session: dict[str, str]
) -> None:
    for wide in ("80", "200"):
        table = runner.invoke(app, ["calls", SESSION], env={"COLUMNS": wide})
        assert table.exit_code == 0, table.output
        _assert_no_raw_controls(table.output)
        # What was there is shown, escaped: the clipboard write, the C1 CSI, the bidi override
        assert "\\x1b]52;c;ZWNobyBvd25lZA==\\x07" in table.output
        assert "\\x9b2J" in table.output and "\\u202e00001 :tnuoma" in table.output
        # and the key's "[red]" is text, not rich markup
        assert "c1\\x1b[2J\\x1b[H[bold]x" in table.output

    listed = runner.invoke(app, ["approvals", "list"], env={"COLUMNS": "120"})
    assert listed.exit_code == 0, listed.output
    _assert_no_raw_controls(listed.output)
    assert "\\u202e" in listed.output

    for args in (["calls", SESSION, "--json"], ["approvals", "list", "--json"],
                 ["show", escaped_session["failed"]]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        _assert_no_raw_controls(result.output)
        # Still JSON, and the same values: the escapes are JSON's own.
        parsed = json.loads(result.output)
        assert BIDI in json.dumps(parsed, ensure_ascii=False)
