"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

The YAML is parsed and held to the production rules (Redis AOF and noeviction, healthchecks,
a scalable worker, exactly one beat, secrets from the environment); every ``dex-tasks`` command
in it is parsed by the real CLI, and every ``DEX_*`` variable must be a setting. Where a compose
client is installed, ``docker compose config`` (or ``docker-compose config``) validates the file
too: it needs no engine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

import pytest
import typer
import yaml

from dex_tasks.cli import app
from dex_tasks.settings import DexSettings
from tests.helpers import ROOT

COMPOSE = ROOT / "docker-compose.yml"
DEX_SERVICES = ("worker", "beat", "api")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]  # type: ignore[no-any-return]


def parse_cli(argv: list[str]) -> Any:
    """Parse ``dex-tasks ARGV`` with the real CLI, without running the command; its context."""
    assert argv[0] == "dex-tasks", argv
    group: Any = typer.main.get_command(app)
    parent = group.make_context("dex-tasks", [argv[1]])
    command = group.get_command(parent, argv[1])
    assert command is not None, f"no dex-tasks command {argv[1]!r}"
    return command.make_context(argv[1], list(argv[2:]), parent=parent)


def test_services_and_commands(compose: dict[str, Any]) -> None:
    svc = services(compose)
    assert set(svc) == {"redis", "postgres", "worker", "beat", "api", "flower"}

    worker = parse_cli(svc["worker"]["command"])
    assert worker.params["tools"] == "workers.example_tools"
    assert parse_cli(svc["beat"]["command"]).info_name == "beat"
    api = parse_cli(svc["api"]["command"])
    assert api.params["host"] == "0.0.0.0"
    for name in DEX_SERVICES:
        assert parse_cli(svc[name]["command"]).params["log_format"] == "json"

    # The worker scales with --scale worker=N: no fixed name, no host port.
    assert "container_name" not in svc["worker"]
    assert "ports" not in svc["worker"]
    # Exactly one beat.
    assert svc["beat"].get("deploy", {}).get("replicas", 1) == 1
    assert "container_name" not in svc["beat"]

    flower = svc["flower"]
    assert flower["image"].startswith("mher/flower")
    assert "--broker=redis://redis:6379/0" in flower["command"]
    assert "redis" in flower["depends_on"]


def test_redis_is_durable_and_never_evicts(compose: dict[str, Any]) -> None:
    redis = services(compose)["redis"]
    command = " ".join(str(part) for part in redis["command"])
    assert command.startswith("redis-server")
    assert "--appendonly yes" in command
    assert "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_dex_services_wait_for_healthy_redis_and_postgres(compose: dict[str, Any]) -> None:
    svc = services(compose)
    assert "pg_isready" in " ".join(svc["postgres"]["healthcheck"]["test"])
    for name in DEX_SERVICES:
        depends = svc[name]["depends_on"]
        assert depends["redis"]["condition"] == "service_healthy"
        assert depends["postgres"]["condition"] == "service_healthy"
    assert "/healthz" in " ".join(svc["api"]["healthcheck"]["test"])


def test_every_dex_variable_is_a_setting_and_secrets_are_not_hard_coded(
    compose: dict[str, Any],
) -> None:
    known = {f"DEX_{name.upper()}" for name in DexSettings.model_fields}
    svc = services(compose)
    for name in DEX_SERVICES:
        env = svc[name]["environment"]
        assert {"DEX_REDIS_URL", "DEX_DATABASE_URL", "DEX_SECRET_KEY"} <= set(env)
        unknown = set(env) - known
        assert not unknown, f"{name}: {sorted(unknown)} are not DexSettings fields"
        # The signing key and the database password come from the environment / .env file.
        assert re.fullmatch(r"\$\{DEX_SECRET_KEY:\?[^}]+\}", env["DEX_SECRET_KEY"])
        assert "${POSTGRES_PASSWORD:?" in env["DEX_DATABASE_URL"]
        assert env["DEX_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["DEX_REDIS_URL"] == "redis://redis:6379/0"
    # The same block for all three, defined once.
    assert svc["worker"]["environment"] == svc["beat"]["environment"] == svc["api"]["environment"]
    assert "${POSTGRES_PASSWORD:?" in svc["postgres"]["environment"]["POSTGRES_PASSWORD"]
    # Every DEX_ name in the file, wherever it appears, is a setting.
    mentioned = set(re.findall(r"\bDEX_[A-Z_]+", COMPOSE.read_text()))
    assert mentioned <= known, sorted(mentioned - known)


def test_dockerfile_builds_a_non_root_image_with_postgres() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert 'pip install ".[postgres]"' in text
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and ".env" in ignored


def _compose_client() -> list[str] | None:
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        probe = subprocess.run([*argv, "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return argv
    return None


def test_compose_config_validates() -> None:
    client = _compose_client()
    if client is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    base = {k: v for k, v in os.environ.items()
            if k not in ("DEX_SECRET_KEY", "POSTGRES_PASSWORD")}
    # Without the secrets the file refuses to render, naming the missing one.
    missing = subprocess.run([*client, "-f", str(COMPOSE), "config", "-q"], cwd=ROOT,
                             env=base, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0
    assert "POSTGRES_PASSWORD" in missing.stderr or "DEX_SECRET_KEY" in missing.stderr
    # With them it validates, and the key reaches the services unchanged.
    env = {**base, "DEX_SECRET_KEY": "k" * 32, "POSTGRES_PASSWORD": "pw-from-env"}
    rendered = subprocess.run([*client, "-f", str(COMPOSE), "config"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    config = yaml.safe_load(rendered.stdout)
    assert config["services"]["api"]["environment"]["DEX_SECRET_KEY"] == "k" * 32
    assert "pw-from-env" in config["services"]["worker"]["environment"]["DEX_DATABASE_URL"]
