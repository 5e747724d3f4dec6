"""Typed settings, read once from the environment (``DEX_`` prefix) and passed around."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from dex_tasks.errors import ConfigurationError


class DexSettings(BaseSettings):
    """Everything dex-tasks can be configured with.

    Each field reads the environment variable ``DEX_<FIELD NAME IN CAPITALS>``.
    """

    model_config = SettingsConfigDict(env_prefix="DEX_", extra="ignore")

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Celery broker and claim keys.",
    )
    database_url: str = Field(
        default="sqlite:///dex_tasks.db",
        description="The store: sqlite:///path or postgresql+psycopg://....",
    )
    secret_key: SecretStr | None = Field(
        default=None,
        description="Signs approval tokens; required by the API and `token` (no default: "
        "a public default would let anyone forge tokens). `demo` makes its own.",
    )
    lease_seconds: float = Field(
        default=30.0, gt=0,
        description="How long a running call's lease lasts without renewal.",
    )
    republish_after_seconds: float = Field(
        default=300.0, gt=0,
        description="A queued call with no delivery for this long is republished.",
    )
    visibility_timeout_seconds: int = Field(
        default=3600, gt=0,
        description="Redis transport visibility timeout; must exceed the longest task.",
    )
    publish_timeout_seconds: float = Field(
        default=2.0, gt=0,
        description="How long call_tool may try to reach the broker before it gives up.",
    )
    claim_ttl_seconds: int = Field(
        default=30 * 24 * 3600, gt=0,
        description="TTL of the Redis claim key of a single-attempt call.",
    )
    sweep_interval_seconds: float = Field(
        default=10.0, gt=0,
        description="How often beat runs the sweeps.",
    )
    catalog_cache_seconds: float = Field(
        default=5.0, ge=0,
        description="How long call_tool caches a tool's catalog entry (0: never).",
    )
    default_max_attempts: int = Field(
        default=3, ge=1,
        description="Attempts of a retrying call when its policy sets none.",
    )
    retry_backoff_base_seconds: float = Field(
        default=1.0, ge=0,
        description="First retry delay; doubled per attempt, with jitter.",
    )
    retry_backoff_max_seconds: float = Field(
        default=60.0, ge=0,
        description="Cap on the retry delay.",
    )
    wait_poll_seconds: float = Field(
        default=1.0, gt=0,
        description="How often wait reads the store while Redis notifications work (a safety "
        "net for a lost notification; without Redis it polls every 5-200 ms).",
    )


    def signing_key(self) -> str:
        """The token-signing secret; :class:`ConfigurationError` when it is not set."""
        value = self.secret_key.get_secret_value() if self.secret_key is not None else ""
        if not value:
            raise ConfigurationError(
                "DEX_SECRET_KEY is not set: it signs approval tokens, and there is no default "
                "(anyone could forge tokens with a public one). Set it to a long random value, "
                "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value


def settings_help() -> str:
    """One line per setting with its environment variable, for CLI help texts."""
    lines = []
    for name, field in DexSettings.model_fields.items():
        lines.append(f"DEX_{name.upper()}: {field.description}")
    return "\n".join(lines)
