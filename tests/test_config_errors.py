"""A configuration mistake is one line naming the variable and the fix, never a traceback:
from the CLI (``dex-tasks worker``, ``calls``) and from ``DexClient.from_env()``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dex_tasks import ConfigurationError, ConflictError, DexClient
from tests.helpers import ROOT, dex_command

MISTAKES = [
    # (variable, value, what the line must say)
    ("DEX_DATABASE_URL", "postgres://dex:hunter2@db/dex",
     "DEX_DATABASE_URL='postgres://dex:***@db/dex' names no driver: use "
     "postgresql+psycopg://dex:***@db/dex"),
    ("DEX_DATABASE_URL", "postgresql://dex@db/dex", "use postgresql+psycopg://dex@db/dex"),
    ("DEX_DATABASE_URL", "sqlite://x.db",
     "DEX_DATABASE_URL='sqlite://x.db' has two slashes: a SQLite URL has three before a "
     "relative path (sqlite:///x.db)"),
    ("DEX_DATABASE_URL", "mysql://db/dex", "the store does not support: use sqlite:///"),
    ("DEX_LEASE_SECONDS", "abc",
     "DEX_LEASE_SECONDS='abc': Input should be a valid number, unable to parse string as a "
     "number; set it to a number"),
    ("DEX_DEFAULT_MAX_ATTEMPTS", "0",
     "DEX_DEFAULT_MAX_ATTEMPTS='0': Input should be greater than or equal to 1"),
]
IDS = [f"{var}={value}" for var, value, _ in MISTAKES]


def env_with(**dex: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
    return {**env, **dex}


def assert_one_line(result: subprocess.CompletedProcess[str], says: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: DEX_") and says in lines[0], lines[0]
    assert "hunter2" not in result.stderr


@pytest.mark.parametrize(("variable", "value", "says"), MISTAKES, ids=IDS)
def test_from_env_raises_one_configuration_error_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError) as err:
        DexClient.from_env()
    assert says in str(err.value) and "\n" not in str(err.value)
    assert err.value.__suppress_context__  # pydantic's dozen lines do not follow it


@pytest.mark.parametrize(("variable", "value", "says"), MISTAKES[::2], ids=IDS[::2])
def test_the_worker_prints_one_line_and_no_traceback(variable: str, value: str,
                                                     says: str) -> None:
    result = subprocess.run([*dex_command(), "worker", "--tools", "workers.example_tools"],
                            cwd=ROOT, env=env_with(**{variable: value}), capture_output=True,
                            text=True, timeout=60)
    assert_one_line(result, says)


def test_a_postgresql_url_without_the_postgres_extra_names_the_extra() -> None:
    # Given an environment where psycopg cannot be imported (None in sys.modules blocks it)
    script = ("import sys; sys.modules['psycopg'] = None\n"
              "from dex_tasks.ops.cli import main\n"
              "main(['calls', 'session-1'])\n")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env=env_with(DEX_DATABASE_URL="postgresql+psycopg://dex@127.0.0.1/dex"))
    assert_one_line(result, "is a PostgreSQL URL, but its driver is not installed: "
                            'pip install -e ".[postgres]" in the dex-tasks checkout')


def test_a_conflicting_repeat_says_what_differs_in_plain_words() -> None:
    assert "with other arguments; a key names exactly one call" in str(
        ConflictError("s/t/c", "arguments"))
    assert "with another tool;" in str(ConflictError("s/t/c", "tool"))
    assert "with another expires_in;" in str(ConflictError("s/t/c", "expires_in"))


def test_settings_are_read_from_secret_files_and_a_variable_wins(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    from pathlib import Path

    from dex_tasks import DexSettings

    # Given a folder of secret files as Docker and Kubernetes mount them
    secrets = Path(str(tmp_path))
    (secrets / "DEX_SECRET_KEY").write_text("key-from-a-file\n")
    (secrets / "DEX_LEASE_SECONDS").write_text("45")
    monkeypatch.setenv("DEX_SECRETS_DIR", str(secrets))
    for name in ("DEX_SECRET_KEY", "DEX_LEASE_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    settings = DexSettings()
    assert settings.signing_key() == "key-from-a-file" and settings.lease_seconds == 45
    # When the variable is set too, it wins
    monkeypatch.setenv("DEX_LEASE_SECONDS", "12")
    assert DexSettings().lease_seconds == 12
    # And a folder that is not there is one clear line
    monkeypatch.setenv("DEX_SECRETS_DIR", str(secrets / "missing"))
    with pytest.raises(ConfigurationError, match=r"DEX_SECRETS_DIR='.*missing' is not a "
                                                 r"directory"):
        DexClient.from_env()
