"""env-worker settings (environment variables, e.g. ENV_THREADS=32)."""

from __future__ import annotations

from pydantic import Field

from shared.platform.settings import ServiceSettings


class EnvWorkerSettings(ServiceSettings):
    service_name: str = "env-worker"
    env_threads: int = Field(32, ge=1, description="threads running env calls (reset/step/close) off the loop")
    read_count: int = Field(128, ge=1, description="requests read per XREADGROUP, entries")
    read_block_ms: int = Field(100, ge=1, description="longest blocking read, milliseconds (bounds stop latency)")
    sweep_interval_s: float = Field(1.0, gt=0, description="how often idle sessions are looked for, seconds")
    reclaim_interval_s: float = Field(5.0, gt=0, description="how often env.requests of dead workers are "
                                      "claimed, seconds")
    reclaim_idle_ms: int = Field(10_000, ge=1, description="a reset pending this long at a dead worker is "
                                 "claimed, milliseconds")
    trim_interval_s: float = Field(10.0, gt=0, description="how often acknowledged env.requests and inbox "
                                   "entries are trimmed, seconds")
    reply_maxlen: int = Field(100_000, ge=100, description="approximate cap of each reply stream, entries")
    max_sessions: int = Field(10_000, ge=1, description="sessions hosted at once; resets beyond it are refused")
    sandbox_modes: str = Field("namespaces", description="sandbox modes for model-written code this worker must "
                               "provide, comma-separated (namespaces, container, none); each is checked at start "
                               "and a mode the host cannot give stops the worker with the reason")
