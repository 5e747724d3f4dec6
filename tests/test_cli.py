"""The ``dex-tasks`` command as a newcomer meets it: errors in one line, tables that fit a
terminal, options named as typed, beat's state where it belongs.

Commands that only read the store run in-process with typer's ``CliRunner`` (or ``main``, the
console script's entry point, for its error handling); ``worker`` and ``beat`` run as real
subprocesses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import typer
from rich.cells import cell_len
from typer.testing import CliRunner

import beat_schedule
from dex_tasks import DexClient, DexSettings
from dex_tasks.ops.cli import app, main
from dex_tasks.settings import default_state_dir
from tests.conftest import settings_env
from tests.helpers import ROOT, dex_command, wait_until
from workers import example_tools

assert example_tools.refund_payment  # registered here: call_tool validates locally

runner = CliRunner()
LONG_SESSION = "session-42"
LONG_CALL = "call_7Hk2Qx9PzA1bR4"


def run_dex(args: list[str], env: dict[str, str],
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*dex_command(), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def cli_env(settings: DexSettings, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The test's settings as DEX_* variables, for in-process and subprocess runs alike."""
    env = settings_env(settings)
    for name, value in env.items():
        if name.startswith("DEX_"):
            monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def session_with_calls(client: DexClient) -> dict[str, str]:
    """A session with a call awaiting approval (Unicode arguments), one failed, one queued."""
    waiting = client.call_tool(session_id=LONG_SESSION, turn_id="turn-3", tool_call_id=LONG_CALL,
                               tool="refund_payment",
                               arguments={"charge_id": "ch_払い戻し_Ünïcødé", "amount_cents": 2500})
    failed = client.call_tool(session_id=LONG_SESSION, turn_id="turn-3", tool_call_id="c2",
                              tool="lookup_order", arguments={"order_id": 7})
    queued = client.call_tool(session_id=LONG_SESSION, turn_id="turn-3", tool_call_id="c3",
                              tool="lookup_order", arguments={"order_id": "1001"})
    assert waiting.interrupt_id is not None and failed.error is not None
    return {"waiting": waiting.key, "interrupt": waiting.interrupt_id, "failed": failed.key,
            "failed_error": failed.error, "queued": queued.key}


def _lines(output: str) -> list[str]:
    return [line.rstrip() for line in output.splitlines()]


def test_calls_table_fits_80_columns_and_never_cuts_a_key(
    cli_env: dict[str, str], session_with_calls: dict[str, str]
) -> None:
    result = runner.invoke(app, ["calls", LONG_SESSION], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = _lines(result.output)
    assert max(cell_len(line) for line in lines) <= 80, result.output
    # Every key whole on one line, with its tool and status whole on it or the next (a row
    # of 80 columns cannot hold this key, tool and status: each call gets two lines instead)
    assert_calls_listed(lines, session_with_calls)
    # The error is printed in full (wrapped by the terminal, not squeezed into a column)
    joined = " ".join(line.strip() for line in lines)
    assert f"{session_with_calls['failed']}: {session_with_calls['failed_error']}" in joined
    assert "…" not in result.output
    # Where a row fits, it is a table, with the effect class from 110 columns on
    assert "non_idempotent_write" not in result.output
    for columns, effect in (("100", False), ("140", True)):
        wider = runner.invoke(app, ["calls", LONG_SESSION], env={"COLUMNS": columns})
        header = _lines(wider.output)[0].split()
        assert header == ["key", "tool", *(["effect"] if effect else []), "status", "tries"]
        assert max(cell_len(line) for line in _lines(wider.output)) <= int(columns)
        assert_calls_listed(_lines(wider.output), session_with_calls)


def assert_calls_listed(lines: list[str], calls: dict[str, str]) -> None:
    for key, tool, status in ((calls["waiting"], "refund_payment", "awaiting_approval"),
                              (calls["failed"], "lookup_order", "failed"),
                              (calls["queued"], "lookup_order", "queued")):
        at = next((i for i, line in enumerate(lines)
                   if line == key or line.startswith(key + " ")), None)
        assert at is not None, f"{key} is not whole on a line:\n" + "\n".join(lines)
        # A table row holds it all; a block has the key alone, the rest on the next line
        row = (lines[at + 1] if lines[at] == key else lines[at]).split()
        assert tool in row and status in row, row


def test_approvals_list_fits_80_columns_and_prints_unicode_as_text(
    cli_env: dict[str, str], session_with_calls: dict[str, str]
) -> None:
    result = runner.invoke(app, ["approvals", "list"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = _lines(result.output)
    # The command to copy is whole on one line, even if it is the longest
    command = (f"dex-tasks approvals approve {LONG_SESSION} "
               f"{session_with_calls['interrupt']}")
    assert any(line.strip() == command for line in lines), result.output
    assert max(cell_len(line) for line in lines if command not in line) <= 80, result.output
    assert session_with_calls["waiting"] in result.output
    assert "ch_払い戻し_Ünïcødé" in result.output and "\\u" not in result.output

    as_json = runner.invoke(app, ["approvals", "list", "--json"])
    assert "ch_払い戻し_Ünïcødé" in as_json.output and "\\u" not in as_json.output
    shown = runner.invoke(app, ["show", session_with_calls["waiting"]])
    assert "ch_払い戻し_Ünïcødé" in shown.output and "\\u" not in shown.output


def test_show_with_an_unknown_key_prints_one_line(
    cli_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["show", "no/such/call"])
    assert exited.value.code == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "error: no tool call is stored under key 'no/such/call'\n"


def test_a_worker_with_a_mistyped_tool_module_says_which_in_one_line(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    # A typo in --tools
    typo = run_dex(["worker", "--tools", "workers.exmaple_tools"], cli_env)
    assert typo.returncode == 2
    assert typo.stderr.strip().splitlines() == [
        "error: cannot import tool module 'workers.exmaple_tools': no module named "
        "'workers.exmaple_tools' (check --tools / DEX_TOOLS and that it is on PYTHONPATH)"]

    # A tool module whose own dependency is missing (named by DEX_TOOLS this time)
    (tmp_path / "needs_stripe.py").write_text("import stripe_sdk_not_installed\n")
    env = {**cli_env, "DEX_TOOLS": "needs_stripe", "PYTHONPATH": str(tmp_path)}
    missing = run_dex(["worker"], env)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "error: tool module 'needs_stripe' imports 'stripe_sdk_not_installed', which is not "
        "installed here"]

    # No tool module at all
    none = run_dex(["worker"], cli_env)
    assert none.returncode == 2
    assert "Traceback" not in none.stderr
    assert none.stderr.strip().splitlines() == [
        "error: no tool modules: pass --tools MODULE[,MODULE] or set DEX_TOOLS "
        "(e.g. DEX_TOOLS=my_company.tools)"]


def test_a_tool_module_with_a_syntax_error_is_one_line_with_file_and_line(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    # Given a tools module that does not compile (line 4)
    (tmp_path / "typo_tools.py").write_text(
        "from dex_tasks import ToolContext, tool\n\n@tool(effect='read')\n"
        "def lookup(ctx: ToolContext, order_id: str) -> dict\n    return {}\n")
    env = {**cli_env, "PYTHONPATH": str(tmp_path)}
    # When a worker imports it: one line with the file, the line and Python's error
    result = run_dex(["worker", "--tools", "typo_tools"], env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: tool module 'typo_tools' does not compile: {tmp_path / 'typo_tools.py'}:4: "
        "expected ':'"]


def test_help_lists_the_commands_and_config_lists_the_settings(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # --help: the commands, and one line on where the settings are (not 160 lines of them)
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0
    assert "│ worker " in result.output and "│ dev " in result.output
    assert "DEX_REDIS_URL" not in result.output and "`dex-tasks config`" in result.output
    assert len(result.output.splitlines()) < 70
    # config: every setting with its value here, secrets only as set, passwords masked
    monkeypatch.setenv("DEX_SECRET_KEY", "never-shown-secret")
    monkeypatch.setenv("DEX_DATABASE_URL", "postgresql+psycopg://dex:hunter2@db/dex")
    shown = runner.invoke(app, ["config"])
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert "DEX_SECRET_KEY=(set)" in lines
    assert "DEX_DATABASE_URL=postgresql+psycopg://dex:***@db/dex" in lines
    assert "DEX_LEASE_SECONDS=30.0  (default)" in lines
    assert sum(line.startswith("DEX_") for line in lines) == len(DexSettings.model_fields)
    assert "never-shown-secret" not in shown.output and "hunter2" not in shown.output


@pytest.mark.parametrize(("args", "option"), [
    (["token", "s1", "--ttl", "-5"], "'--ttl'"),
    (["token", "s1", "--ttl", "nan"], "'--ttl'"),
    (["token", "s1", "--ttl", "0"], "'--ttl'"),
    (["worker", "--tools", "workers.example_tools", "-c", "0"], "'-c' / '--concurrency'"),
])
def test_option_errors_name_the_option_as_typed(
    cli_env: dict[str, str], args: list[str], option: str
) -> None:
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert f"Invalid value for {option}" in result.output, result.output
    assert "ttl_seconds" not in result.output and "Traceback" not in result.output


def test_beat_keeps_its_schedule_in_the_state_directory(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    # Given two beats on one machine sharing a state directory
    state = tmp_path / "state"
    env = {**cli_env, "DEX_STATE_DIR": str(state)}
    beats = [subprocess.Popen([*dex_command(), "beat"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for _ in range(2)]
    try:
        # Then each gets a schedule file of its own there, with a stable name
        def schedules() -> set[str]:
            if not state.exists():
                return set()
            return {p.name.split(".")[0] for p in state.iterdir()
                    if not p.name.endswith(".lock")}

        wait_until(lambda: schedules() == {"beat-schedule", "beat-schedule-2"}, 30,
                   "both beats to open their schedule files")
        assert all(beat.poll() is None for beat in beats)
    finally:
        for beat in beats:
            os.killpg(beat.pid, signal.SIGKILL)
            beat.wait(10)

    # And a beat started after they are gone takes the first name again
    path, lock = beat_schedule.schedule_file(state)
    assert path == state / "beat-schedule"
    lock.close()


def test_the_default_state_directory_is_per_user(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.delenv("DEX_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert DexSettings().state_dir == tmp_path / "xdg" / "dex-tasks"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "dex-tasks"


def test_an_unwritable_state_directory_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    from dex_tasks.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="DEX_STATE_DIR"):
        beat_schedule.schedule_file(blocker / "state")


def test_start_up_waits_for_a_store_that_is_not_answering_yet() -> None:
    # A worker or beat starting while the database restarts (or drops connections) waits for
    # it instead of exiting; anything else (an out-of-date schema) is not waited for.
    from dex_tasks.errors import SchemaOutOfDateError, StoreUnavailableError
    from dex_tasks.ops.cli import until_store_answers

    tries: list[float] = []

    def flaky() -> str:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise StoreUnavailableError("the store at postgresql://db failed: terminating")
        return "published"

    assert until_store_answers(flaky, wait=10) == "published"
    assert len(tries) == 3 and tries[2] - tries[0] >= 1.0  # it paused between tries

    def old_schema() -> None:
        raise SchemaOutOfDateError("run `dex-tasks db upgrade`")

    started = time.monotonic()
    with pytest.raises(SchemaOutOfDateError):
        until_store_answers(old_schema, wait=10)
    assert time.monotonic() - started < 1.0

    def down() -> None:
        raise StoreUnavailableError("the store at postgresql://db failed: refused")

    with pytest.raises(StoreUnavailableError):
        until_store_answers(down, wait=1.0)


def test_a_server_no_integration_registers_is_one_line_and_exit_2() -> None:
    # Given a server name no installed integration registers in the entry points
    from dex_tasks.ops.cli_processes import server_entry_point

    # When the CLI looks it up, then it says so in one line and exits 2, importing nothing
    with pytest.raises(typer.Exit) as raised:
        server_entry_point("no-such-server")
    assert raised.value.exit_code == 2
    # And the registered one is the MCP integration's serve, loaded only now
    from dex_tasks.integrations.mcp_server import serve

    assert server_entry_point("mcp") is serve
