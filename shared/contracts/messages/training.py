"""Streams between the store, the trainer and the controller (see shared/contracts/streams.py for the whole
table).

- `results.accepted` (controller -> trainer): the only input the trainer trains on. At-least-once: the trainer
  takes one result per (run, task, sample); `result=None` marks a slot out of attempts.
- `trainer.progress` (trainer -> controller): the policy version reached, the groups consumed, or why a run
  cannot be trained. Idempotent and cumulative on the controller's side, so the trainer re-sends it freely.

More: docs/architecture.md#results-and-trainer-progress
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from shared.contracts.messages.codec import Message
from shared.contracts.messages.trajectory import EpisodeResult


class AcceptedResult(Message):
    TYPE = "accepted_result"
    SCHEMA_VERSION = 1

    run_id: str
    task_id: str
    sample_idx: int = Field(ge=0)
    attempt: int = Field(ge=0)
    batch_idx: int = Field(ge=0, description="training batch of the slot: with task_id, its group")
    greedy: bool = False
    result: EpisodeResult | None = Field(
        None, description="the stored completed result; None: the slot is out of attempts (final failure)")
    traceparent: str | None = Field(
        None, description="W3C traceparent of the store span that accepted the result (docs/observability.md); "
        "None: tracing off, or a writer that predates the field")

    @classmethod
    def stored(cls, result: EpisodeResult, traceparent: str | None = None) -> AcceptedResult:
        return cls(run_id=result.run_id, task_id=result.task_id, sample_idx=result.sample_idx,
                   attempt=result.attempt, batch_idx=result.batch_idx, greedy=result.greedy, result=result,
                   traceparent=traceparent)


class ConsumedGroup(BaseModel):
    model_config = ConfigDict(extra="ignore")

    task_id: str
    batch_idx: int = Field(ge=0)
    status: str = Field(description="used (by the step that made `version`), or why it was dropped: stale, "
                        "filtered, incomplete, excluded")


class TrainerProgress(Message):
    TYPE = "trainer_progress"
    SCHEMA_VERSION = 1

    run_id: str
    version: int = Field(ge=0, description="the trainer's policy version (steps committed) for this run; 0 with "
                         "`error`")
    groups: list[ConsumedGroup] = Field(default_factory=list)
    error: str | None = Field(
        None, description="the trainer cannot train this run (its model or checkpoint will not load): why; it "
        "lets the run's lease go and does not try it again until it restarts")
