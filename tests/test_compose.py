"""docker-compose.yml, the Dockerfile and the package metadata, checked without a Docker engine.

The YAML is parsed and held to the production rules (Redis AOF and noeviction, healthchecks,
a scalable worker, exactly one beat, secrets from the environment, the user's tool module and
never the examples); every ``dex-tasks`` command in it is parsed by the real CLI, and every
``DEX_*`` variable must be a setting. ``docker compose config`` (or Debian's
``docker-compose config``) validates the file as a user would render it: it needs no engine.
A real worker imports a tool package the way the image's mount provides it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from dex_tasks import CallStatus, DexClient
from dex_tasks.broker import redis_clients
from dex_tasks.ops.cli import app
from dex_tasks.registry import get_local_tool
from dex_tasks.settings import DexSettings
from tests.conftest import settings_env
from tests.helpers import ROOT, WorkerProcess, start_process

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
    assert set(svc) == {"redis", "postgres", "worker", "beat", "api", "flower",
                        "otel-collector", "jaeger"}

    # The workers run the tool module the user names; the example tools appear nowhere
    worker = parse_cli(svc["worker"]["command"])
    assert worker.params["tools"] == "${DEX_TOOLS}"
    assert "example_tools" not in COMPOSE.read_text().replace(
        "DEX_TOOLS=workers.example_tools", "")  # (the comment that tells how to try them)
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
    # Flower runs from the dex image with the module-level app, so it follows DEX_REDIS_URL.
    assert flower["command"] == ["celery", "-A", "dex_tasks", "flower", "--port=5555"]
    assert flower["environment"]["DEX_REDIS_URL"] == svc["worker"]["environment"]["DEX_REDIS_URL"]
    assert [str(port) for port in flower["ports"]] == ["127.0.0.1:5555:5555"]
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
    # tests/test_health.py runs these very commands against a real worker and beat
    assert svc["worker"]["healthcheck"]["test"][1:] == ["dex-tasks", "status", "--check", "worker"]
    assert svc["beat"]["healthcheck"]["test"][1:] == ["dex-tasks", "status", "--check", "beat"]


def test_every_dex_variable_is_a_setting_and_secrets_are_not_hard_coded(
    compose: dict[str, Any],
) -> None:
    known = {f"DEX_{name.upper()}" for name in DexSettings.model_fields}
    svc = services(compose)
    for name in DEX_SERVICES:
        env = svc[name]["environment"]
        assert {"DEX_REDIS_URL", "DEX_DATABASE_URL", "DEX_SECRET_KEY", "DEX_TOOLS"} <= set(env)
        unknown = set(env) - known - {"OTEL_EXPORTER_OTLP_ENDPOINT"}  # OpenTelemetry's own
        assert not unknown, f"{name}: {sorted(unknown)} are not DexSettings fields"
        # The signing key and the database password come from the environment / .env file.
        assert re.fullmatch(r"\$\{DEX_SECRET_KEY:\?[^}]+\}", env["DEX_SECRET_KEY"])
        assert re.fullmatch(r"\$\{DEX_TOOLS:\?[^}]+\}", env["DEX_TOOLS"])
        assert "${POSTGRES_PASSWORD:?" in env["DEX_DATABASE_URL"]
        assert env["DEX_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["DEX_REDIS_URL"] == "redis://redis:6379/0"
    # The same block for all three, defined once.
    assert svc["worker"]["environment"] == svc["beat"]["environment"] == svc["api"]["environment"]
    assert "${POSTGRES_PASSWORD:?" in svc["postgres"]["environment"]["POSTGRES_PASSWORD"]
    # Every DEX_ name in the file, wherever it appears, is a setting.
    mentioned = set(re.findall(r"\bDEX_[A-Z_]+", COMPOSE.read_text()))
    assert mentioned <= known, sorted(mentioned - known)


def test_dockerfile_builds_a_non_root_image_with_postgres_and_the_users_tools() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert 'pip install ".[postgres,flower,otel]"' in text
    # The user's tools: a build argument installed after dex-tasks, and a mount point on the
    # import path
    assert re.search(r"^ARG TOOLS_REQUIREMENTS=", text, re.M)
    assert "pip install $TOOLS_REQUIREMENTS" in text
    assert re.search(r"^ENV PYTHONPATH=/opt/dex-tools$", text, re.M)
    assert re.search(r"^COPY pyproject.toml README.md LICENSE ", text, re.M)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored and ".env" in ignored


def test_package_metadata_uses_the_spdx_license_form() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    # The installed distribution carries it as PEP 639 metadata
    assert importlib.metadata.metadata("dex-tasks")["License-Expression"] == "Apache-2.0"


@functools.cache
def _compose_client() -> list[str] | None:
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        probe = subprocess.run([*argv, "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return argv
    return None


USER_SETTINGS = {"DEX_SECRET_KEY": "k" * 32, "POSTGRES_PASSWORD": "pw-from-env",
                 "DEX_TOOLS": "my_company.tools"}


def compose_config(env: dict[str, str], tmp_path: Path,
                   *files: Path | str) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` as a user would run it, with only ``env`` set (no .env)."""
    client = _compose_client()
    if client is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs `docker compose` or `docker-compose` (no engine) installed")
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    base = {k: v for k, v in os.environ.items()
            if k not in USER_SETTINGS and not k.startswith(("DEX_", "TOOLS_"))}
    empty = tmp_path / "empty.env"
    empty.write_text("")
    # Paths are files (-f); other strings are options (--profile tracing).
    args = [arg for f in (COMPOSE, *files)
            for arg in (("-f", str(f)) if isinstance(f, Path) else (f,))]
    return subprocess.run([*client, "--env-file", str(empty), *args, "config"], cwd=ROOT,
                          env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_compose_config_validates_and_names_what_is_missing(tmp_path: Path) -> None:
    # Without the secrets the file refuses to render, naming one that is missing
    nothing = compose_config({}, tmp_path)
    assert nothing.returncode != 0
    assert any(name in nothing.stderr for name in USER_SETTINGS), nothing.stderr
    # Without the tool module too: there is no default, least of all the example tools
    no_tools = compose_config({**USER_SETTINGS, "DEX_TOOLS": ""}, tmp_path)
    assert no_tools.returncode != 0
    assert "set DEX_TOOLS in .env to your tool module(s)" in no_tools.stderr, no_tools.stderr
    # With them it validates, and the values reach the services unchanged
    rendered = compose_config(USER_SETTINGS, tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    config = yaml.safe_load(rendered.stdout)
    assert config["services"]["api"]["environment"]["DEX_SECRET_KEY"] == "k" * 32
    assert "pw-from-env" in config["services"]["worker"]["environment"]["DEX_DATABASE_URL"]


def test_the_tracing_profile_adds_a_collector_and_jaeger(compose: dict[str, Any],
                                                        tmp_path: Path) -> None:
    # Without the profile nothing of it runs, and the services export nowhere
    svc = services(compose)
    for name in ("otel-collector", "jaeger"):
        assert svc[name]["profiles"] == ["tracing"], name
    plain = compose_config(USER_SETTINGS, tmp_path)
    assert plain.returncode == 0, plain.stderr
    rendered = yaml.safe_load(plain.stdout)
    for name in ("otel-collector", "jaeger"):  # (Compose v1 renders them, with the profile)
        assert rendered["services"].get(name, {"profiles": ["tracing"]})["profiles"] == \
            ["tracing"]
    assert not rendered["services"]["worker"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    # With it, and the endpoint docs/tracing.md gives, worker, beat and API export to the
    # collector, which forwards to Jaeger (its UI on the loopback only)
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4318"}
    traced = compose_config({**USER_SETTINGS, **endpoint}, tmp_path, "--profile", "tracing")
    assert traced.returncode == 0, traced.stderr
    config = yaml.safe_load(traced.stdout)["services"]
    assert {"otel-collector", "jaeger"} <= set(config)
    for name in DEX_SERVICES:
        assert config[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == \
            "http://otel-collector:4318"
    [port] = config["jaeger"]["ports"]
    assert (port if isinstance(port, str) else
            f"{port['host_ip']}:{port['published']}:{port['target']}").startswith(
        "127.0.0.1:16686:16686")
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert collector["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    [mounted] = config["otel-collector"]["volumes"]
    assert "deploy/otel-collector.yaml:/etc/otelcol/config.yaml" in (
        mounted if isinstance(mounted, str) else f"{mounted['source']}:{mounted['target']}")


def test_compose_runs_the_users_tool_module_installed_or_mounted(tmp_path: Path) -> None:
    # Given a user's settings: their module, a requirement to install, a directory to mount
    env = {**USER_SETTINGS, "DEX_TOOLS": "my_company.tools,my_company.billing",
           "TOOLS_REQUIREMENTS": "my-company-tools==1.4 stripe>=9", "TOOLS_DIR": "/srv/tools"}
    rendered = compose_config(env, tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    svc = yaml.safe_load(rendered.stdout)["services"]

    # Then the worker's command names their module, as the real CLI parses it
    worker = parse_cli(svc["worker"]["command"])
    assert worker.params["tools"] == "my_company.tools,my_company.billing"
    for name in ("worker", "beat"):
        # the module is also DEX_TOOLS (sweep and reconcile run in these containers), the
        # requirement is built into the image, and the directory is mounted read-only on the
        # image's PYTHONPATH
        assert svc[name]["environment"]["DEX_TOOLS"] == "my_company.tools,my_company.billing"
        assert svc[name]["build"]["args"]["TOOLS_REQUIREMENTS"] == "my-company-tools==1.4 stripe>=9"
        assert "/srv/tools:/opt/dex-tools:ro" in svc[name]["volumes"]
    # And the example tools run nowhere
    assert "example_tools" not in rendered.stdout

    # The demo is the same file with the example tools named
    demo = compose_config({**USER_SETTINGS, "DEX_TOOLS": "workers.example_tools"}, tmp_path)
    assert demo.returncode == 0, demo.stderr
    demo_worker = yaml.safe_load(demo.stdout)["services"]["worker"]
    assert parse_cli(demo_worker["command"]).params["tools"] == "workers.example_tools"


def test_the_readmes_tls_override_validates(tmp_path: Path) -> None:
    # The docker-compose.override.yml docs/deploying.md shows
    readme = (ROOT / "docs" / "deploying.md").read_text()
    block = re.search(r"```yaml\n(# docker-compose.override.yml[^\n]*\n.*?)```", readme, re.S)
    assert block is not None, "docs/deploying.md lost its TLS override example"
    override = tmp_path / "docker-compose.override.yml"
    override.write_text(block.group(1))
    rendered = compose_config({**USER_SETTINGS, "REDIS_PASSWORD": "r-pw"}, tmp_path, override)
    assert rendered.returncode == 0, rendered.stderr
    svc = yaml.safe_load(rendered.stdout)["services"]
    for name in DEX_SERVICES:
        env = svc[name]["environment"]
        assert env["DEX_REDIS_URL"].startswith("rediss://:r-pw@")
        assert env["DEX_REDIS_TLS_CA_FILE"] == "/certs/ca.crt"
        assert "sslmode=verify-full" in env["DEX_DATABASE_URL"]
        assert env["DEX_SECRET_KEY"] == "k" * 32  # the base file's keys are kept
        assert any(v.endswith("/certs:/certs:ro") for v in svc[name]["volumes"])
        # Every DEX_ variable it sets is a setting and checks out
        settings = DexSettings.model_validate(
            {k[4:].lower(): v for k, v in env.items() if k.startswith("DEX_")})
        assert redis_clients.target(settings).tls


def test_env_example_lists_every_variable_the_compose_file_reads() -> None:
    read = set(re.findall(r"\$\{([A-Z_]+)", COMPOSE.read_text()))
    listed = set(re.findall(r"^([A-Z_]+)=", (ROOT / ".env.example").read_text(), re.M))
    assert read == listed, (sorted(read - listed), sorted(listed - read))


def test_a_worker_imports_a_tool_package_from_the_mount_named_by_dex_tools(
    settings: DexSettings, tmp_path: Path
) -> None:
    # Given a tool package in a directory of its own (what the image mounts at /opt/dex-tools
    # and puts on PYTHONPATH), which the test process never imports
    package = tmp_path / "mounted" / "acme_tools"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tools.py").write_text(
        "from dex_tasks import ToolContext, tool\n\n\n"
        "@tool(effect='read')\n"
        "def acme_greeting(ctx: ToolContext, name: str) -> str:\n"
        "    return f'hello {name}'\n"
    )
    env = {**settings_env(settings), "DEX_TOOLS": "acme_tools.tools",
           "PYTHONPATH": str(tmp_path / "mounted")}

    # When a worker starts with no --tools, as the compose file's environment has it
    log = tmp_path / "worker.log"
    worker = WorkerProcess(start_process(["worker", "-c", "1"], env, log), log)
    try:
        worker.wait_ready()
        # Then it published the tool, and an agent without the code runs it
        with DexClient(settings) as client:
            assert [row.name for row in client.store.list_catalog()] == ["acme_greeting"]
            assert get_local_tool("acme_greeting") is None
            record = client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                      tool="acme_greeting", arguments={"name": "ops"})
            done = client.wait(record.key, 30)
        assert done.status is CallStatus.SUCCEEDED and done.result == "hello ops"
    finally:
        worker.discard()
