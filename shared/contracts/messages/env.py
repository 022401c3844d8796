"""Streams `env.requests` (first reset, any env worker), `env.inbox.<env worker>` (later step/close of a
sticky session) and `env.replies.<rollout worker>` (answers)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shared.contracts.messages.codec import Message

# infra: the env's sandbox failed (a container died or hung): the trajectory is an infrastructure failure
EnvErrorKind = Literal["user", "timeout", "session_lost", "bad_request", "infra"]


class EnvRequest(Message):
    TYPE = "env_request"
    SCHEMA_VERSION = 1

    request_id: str
    op: Literal["reset", "step", "close"]
    session_id: str = Field(description="one per trajectory; chosen by the rollout worker")
    run_id: str
    env: str = Field(description="registered env name or import path")
    env_args: dict[str, Any] = Field(default_factory=dict)
    task: dict[str, Any] | None = Field(None, description="reset: the dataset row for env.from_dict")
    action: Any = Field(None, description="step: the agent's action")
    reply_to: str = Field(description="stream for the EnvReply; empty: send none (fire-and-forget close)")
    timeout_s: float = Field(30.0, gt=0, description="per-call limit on the env method, seconds")
    session_ttl_s: float = Field(900.0, gt=0, description="idle lifetime after which the session is closed")
    sent_at: float = Field(description="unix seconds")
    traceparent: str | None = Field(
        None, description="W3C traceparent of the rollout worker's env call span (docs/observability.md); "
        "None: tracing off, or a writer that predates the field")


class EnvReply(Message):
    TYPE = "env_reply"
    SCHEMA_VERSION = 1

    request_id: str
    session_id: str
    env_worker_id: str = Field(description="owner of the session; later requests go to its inbox")
    ok: bool
    observation: Any = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = Field(default_factory=dict)
    final_reward: float | None = Field(None, description="env.compute_final_reward() when done, if defined")
    closed: bool = Field(False, description="the env worker closed the session after this step (done): the "
                         "session is gone and needs no close")
    error: str | None = Field(None, description="traceback or reason when not ok")
    error_kind: EnvErrorKind | None = None
    elapsed_ms: float = 0.0
