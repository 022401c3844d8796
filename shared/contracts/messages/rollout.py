"""Stream `rollout.tasks`: controller -> rollout workers. One message per (task, sample_idx, attempt)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from shared.contracts.messages.codec import Message


class RolloutTask(Message):
    TYPE = "rollout_task"
    SCHEMA_VERSION = 1

    run_id: str
    task_id: str
    sample_idx: int = Field(ge=0)
    attempt: int = Field(0, ge=0, description="0 first; +1 each re-dispatch after an infrastructure failure")
    task: dict[str, Any] = Field(description="the dataset row, passed to env.from_dict / workflow.run")
    batch_idx: int = Field(0, ge=0, description="training batch the sample belongs to (staleness window)")
    dispatch_version: int = Field(0, ge=0, description="trainer policy version when dispatched")
    greedy: bool = Field(False, description="ReMax baseline sample: decode greedily")
    dispatched_at: float = Field(description="unix seconds")
    deadline_s: float = Field(600.0, gt=0, description="trajectory wall budget from start, seconds")
    lease_expires_at: float | None = Field(
        None, description="unix seconds (controller's clock) when this attempt's ledger lease expires and the "
        "controller re-dispatches it; a worker does not start the task after it and abandons it at it. None: "
        "sent by a controller that predates the field")
    traceparent: str | None = Field(
        None, description="W3C traceparent of the unit's dispatch span (docs/observability.md); None: tracing "
        "off, or a writer that predates the field")

    def lease_left(self, now: float) -> float:
        """Seconds until the attempt's lease expires (negative: expired; inf: no lease given)."""
        return math.inf if self.lease_expires_at is None else self.lease_expires_at - now

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.run_id, self.task_id, self.sample_idx, self.attempt)
