"""Process settings from the environment (pydantic-settings). Secrets and URLs come only from here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.contracts.messages.codec import DEFAULT_MAX_ENTRY_BYTES


class ServiceSettings(BaseSettings):
    """What every service reads at start. Build it in `main`, never at import."""

    model_config = SettingsConfigDict(env_file=None, extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for streams, heartbeats and Celery")
    database_url: str = Field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres", description="SQLAlchemy URL (psycopg 3)"
    )
    data_dir: Path = Field(Path(".data"), description="Local state: checkpoints, caches, logs")
    service_name: str = Field("flywheel", description="Name used in logs, metrics and heartbeats")
    worker_id: str | None = Field(None, description="Stable consumer name; defaults to <host>-<pid>")
    log_format: str = Field("auto", description="'json', 'text', or 'auto' (json when not a TTY)")
    log_level: str = Field("INFO")
    health_host: str = Field("0.0.0.0", description="Interface the /healthz and /metrics server binds")
    health_port: int = Field(0, description="Port for /healthz and /metrics; 0 picks a free port")
    heartbeat_interval_s: float = Field(2.0, gt=0)
    otel_exporter_otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP collector (Jaeger: http://jaeger:4318): export this service's trace spans "
        "there; unset: no tracing (docs/observability.md)")
    max_entry_bytes: int = Field(
        DEFAULT_MAX_ENTRY_BYTES, ge=1024, description="Largest stream entry this process decodes, bytes; larger entries "
        "are dead-lettered (or skipped by readers without a group)"
    )

    def loggable(self) -> dict[str, Any]:
        """The resolved config for the start-up log line, secrets masked: passwords inside URLs, and the value
        of any field whose name says token, password, secret or key. Every service logs this, never the raw
        config, so a new secret field is masked without anyone remembering to exclude it."""
        out: dict[str, Any] = {}
        for name, value in self.model_dump(mode="json").items():
            if _SECRET_NAME.search(name):
                out[name] = "***" if value else value
            elif isinstance(value, str) and "://" in value:
                out[name] = mask_url(value)
            else:
                out[name] = value
        return out

    @field_validator("database_url")
    @classmethod
    def _psycopg3(cls, v: str) -> str:
        # Users paste plain postgres:// URLs; SQLAlchemy would pick psycopg2, which is not installed.
        for prefix in ("postgresql://", "postgres://"):
            if v.startswith(prefix):
                return "postgresql+psycopg://" + v[len(prefix):]
        return v

    @field_validator("log_format")
    @classmethod
    def _fmt(cls, v: str) -> str:
        if v not in ("json", "text", "auto"):
            raise ValueError(f"LOG_FORMAT must be json, text or auto, got {v!r}")
        return v


_SECRET_NAME = re.compile(r"token|password|passwd|secret|api_key|_key$", re.I)


def mask_url(url: str) -> str:
    """`scheme://user:***@host/db`: keeps what helps debugging (which server), drops the password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
