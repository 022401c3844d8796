"""The Postgres schema (SQLAlchemy 2). Changed only through alembic revisions in migrations/.

Natural keys make re-delivery harmless: an episode is unique by (run_id, task_id, sample_idx, attempt), its
trajectories by (episode_id, traj_idx), steps by (trajectory_id, step_idx). The rollout ledger has one row per
dispatched attempt: Postgres, not Redis, is the record of what was dispatched and what ended.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, REAL, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

RUN_STATUSES = ("pending", "running", "paused", "stopping", "stopped", "completed", "failed")
TERMINAL_RUN_STATUSES = ("stopped", "completed", "failed")
LEDGER_STATUSES = ("dispatched", "completed", "failed", "lost")


class Base(DeclarativeBase):
    pass


def _now() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


def _uuid_pk() -> Mapped[uuid.UUID]:
    return mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(String(200), nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)  # train | eval | tinker (docs/tinker.md)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="pending", index=True)
    # +1 with every status change, in its transaction: run control is ordered by it, not by hosts' clocks
    status_version: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0, server_default="0")
    config: Mapped[dict] = mapped_column(JSONB, nullable=False)
    policy_version: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    summary: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)  # e.g. pass@k for eval runs
    # Why a running run makes no progress (the controller detects it; null while it progresses) and since when.
    stall_reason: Mapped[str | None] = mapped_column(Text)
    stalled_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Progress that teaches nothing, e.g. a training run whose groups carry no learning signal (null: none).
    warning: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = _now()
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )


class _Lease:
    """A service's lease on a run: see shared/platform/leases.py. Expiry is judged by the database's clock, so hosts with
    skewed clocks never both believe they hold a lease."""

    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    owner: Mapped[str] = mapped_column(String(200), nullable=False)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class ControllerLease(_Lease, Base):
    """Which controller drives a run (written by controllers only)."""

    __tablename__ = "controller_leases"


class TrainerLease(_Lease, Base):
    """Which trainer trains a run (written by trainers only)."""

    __tablename__ = "trainer_leases"


class ConsumedGroupRow(Base):
    """The controller's record of what the trainer consumed, one row per group (task, batch), from the
    `trainer.progress` stream: used by a step, or dropped with a reason (stale, filtered, incomplete, excluded).
    Dropped groups widen the dispatch window so replacements are dispatched."""

    __tablename__ = "consumed_groups"

    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    task_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    batch_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = _now()


class RunEvent(Base):
    __tablename__ = "run_events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    ts: Mapped[datetime] = _now()
    kind: Mapped[str] = mapped_column(String(64), nullable=False)  # status_changed, dead_lettered, ...
    message: Mapped[str] = mapped_column(Text, nullable=False, default="")
    data: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)


class Dataset(Base):
    """One immutable version of a dataset split: re-importing (name, split) adds version n+1 and never touches
    the rows of earlier versions, which the runs that pinned them keep reading."""

    __tablename__ = "datasets"
    __table_args__ = (UniqueConstraint("name", "split", "version", name="uq_datasets_name_split_version"),)

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(String(200), nullable=False)
    split: Mapped[str] = mapped_column(String(64), nullable=False, default="train")
    version: Mapped[int] = mapped_column(Integer, nullable=False, default=1, server_default="1")
    source: Mapped[str] = mapped_column(Text, nullable=False, default="")  # file path, generator name, upload
    num_rows: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    info: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    created_at: Mapped[datetime] = _now()


class DatasetRow(Base):
    __tablename__ = "dataset_rows"

    dataset_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[str] = mapped_column(String(200), nullable=False)
    data: Mapped[dict] = mapped_column(JSONB, nullable=False)
    data_source: Mapped[str] = mapped_column(String(200), nullable=False, default="")


class RolloutTaskRow(Base):
    """The dispatched-task ledger: one row per (run, task, sample, attempt) put on `rollout.tasks`."""

    __tablename__ = "rollout_tasks"
    __table_args__ = (Index("ix_rollout_tasks_run_status", "run_id", "status"),)

    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    task_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    sample_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="dispatched")
    batch_idx: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    epoch: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    greedy: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    dispatch_version: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    dispatched_at: Mapped[datetime] = _now()
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # NULL from the ledger insert until the task is known to be on `rollout.tasks`: a controller that dies in
    # between leaves such rows, and the controller that takes the run over publishes them again.
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    worker_id: Mapped[str | None] = mapped_column(String(200))
    error: Mapped[str | None] = mapped_column(Text)


class EpisodeRow(Base):
    __tablename__ = "episodes"
    __table_args__ = (
        UniqueConstraint("run_id", "task_id", "sample_idx", "attempt", name="uq_episodes_natural_key"),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    task_id: Mapped[str] = mapped_column(String(200), nullable=False)
    sample_idx: Mapped[int] = mapped_column(Integer, nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    status: Mapped[str] = mapped_column(String(16), nullable=False)  # completed | error | failed
    termination_reason: Mapped[str] = mapped_column(String(32), nullable=False)
    is_correct: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    reward: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    greedy: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    batch_idx: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    policy_version_min: Mapped[int | None] = mapped_column(Integer)
    policy_version_max: Mapped[int | None] = mapped_column(Integer)
    task: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    metrics: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    info: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    worker_id: Mapped[str] = mapped_column(String(200), nullable=False, default="")
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _now()

    trajectories: Mapped[list[TrajectoryRow]] = relationship(back_populates="episode", passive_deletes=True)


class TrajectoryRow(Base):
    __tablename__ = "trajectories"
    __table_args__ = (
        UniqueConstraint("episode_id", "traj_idx", name="uq_trajectories_episode_idx"),
        Index("ix_trajectories_run_version", "run_id", "policy_version_max"),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    episode_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), nullable=False)
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    task_id: Mapped[str] = mapped_column(String(200), nullable=False)
    sample_idx: Mapped[int] = mapped_column(Integer, nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    traj_idx: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    uid: Mapped[str] = mapped_column(String(64), nullable=False)
    name: Mapped[str] = mapped_column(String(100), nullable=False, default="agent")
    reward: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    termination_reason: Mapped[str] = mapped_column(String(32), nullable=False)
    num_steps: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    response_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    policy_version_min: Mapped[int | None] = mapped_column(Integer)
    policy_version_max: Mapped[int | None] = mapped_column(Integer)
    mismatch: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    info: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    created_at: Mapped[datetime] = _now()

    episode: Mapped[EpisodeRow] = relationship(back_populates="trajectories")


class StepRecordRow(Base):
    """A step as stored: its chat as the messages it added to the step before's (`chat_added`; the chat began at
    step `chat_from`, which holds it whole when a step's chat does not extend the one before), and its token
    arrays only where they are not a slice of the trajectory's stream (`tokens_in_stream` false). Read steps as
    the view `steps` (the whole chat of each step); its tokens as the view `token_arrays`."""

    __tablename__ = "step_records"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("trajectories.id", ondelete="CASCADE"), primary_key=True
    )
    step_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    chat_added: Mapped[list] = mapped_column(JSONB, nullable=False, default=list)
    observation: Mapped[dict | list | str | None] = mapped_column(JSONB)
    thought: Mapped[str] = mapped_column(Text, nullable=False, default="")
    action: Mapped[dict | list | str | None] = mapped_column(JSONB)
    model_response: Mapped[str] = mapped_column(Text, nullable=False, default="")
    reward: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    done: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    mc_return: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    info: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    weight_version: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    response_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    gen_ms: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    env_ms: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    chat_from: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    tokens_in_stream: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)


class TokenStreamRow(Base):
    """Token arrays as stored: step_idx = -1 is the trajectory's assembled multi-turn stream (prompt_ids,
    response_ids with loss_mask, logprobs and versions aligned to response_ids), stored once; a row with
    step_idx >= 0 holds a step whose prompt/response/logprobs are not a slice of that stream (a retokenized or
    rewritten context)."""

    __tablename__ = "token_streams"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("trajectories.id", ondelete="CASCADE"), primary_key=True
    )
    step_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    prompt_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer), nullable=False, default=list)
    response_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer), nullable=False, default=list)
    logprobs: Mapped[list[float]] = mapped_column(ARRAY(REAL), nullable=False, default=list)
    loss_mask: Mapped[list[int] | None] = mapped_column(ARRAY(SmallInteger))
    versions: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))


class View(DeclarativeBase):
    """Views (migrations create them; `Base.metadata` holds tables only): read-only."""


class StepRow(View):
    """The view `steps`: every step with its whole chat (`chat_completions`), rebuilt from `step_records`."""

    __tablename__ = "steps"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    step_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    chat_completions: Mapped[list] = mapped_column(JSONB)
    observation: Mapped[dict | list | str | None] = mapped_column(JSONB)
    thought: Mapped[str] = mapped_column(Text)
    action: Mapped[dict | list | str | None] = mapped_column(JSONB)
    model_response: Mapped[str] = mapped_column(Text)
    reward: Mapped[float] = mapped_column(Float)
    done: Mapped[bool] = mapped_column(Boolean)
    mc_return: Mapped[float] = mapped_column(Float)
    info: Mapped[dict] = mapped_column(JSONB)
    weight_version: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    response_tokens: Mapped[int] = mapped_column(Integer)
    gen_ms: Mapped[float] = mapped_column(Float)
    env_ms: Mapped[float] = mapped_column(Float)


class TokenArrayRow(View):
    """The view `token_arrays` (queryable: `array_length(response_ids, 1)`): step_idx = -1 is the trajectory's
    assembled stream; step_idx >= 0 that step's prompt/response/logprobs, sliced from the stream where they lie
    in it (`token_streams` holds the rest)."""

    __tablename__ = "token_arrays"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    step_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    prompt_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    response_ids: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    logprobs: Mapped[list[float]] = mapped_column(ARRAY(REAL))
    loss_mask: Mapped[list[int] | None] = mapped_column(ARRAY(SmallInteger))
    versions: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    uri: Mapped[str] = mapped_column(Text, nullable=False)
    path: Mapped[str | None] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    metrics: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="available")  # available | deleted
    # kept by retention whatever its age, with the versions it is built on (a named Tinker sampler checkpoint)
    pinned: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False, server_default="false")
    created_at: Mapped[datetime] = _now()


class Metric(Base):
    """Long-format time series: one row per (run, name, step). `step` is the policy version for training."""

    __tablename__ = "metrics"
    __table_args__ = (Index("ix_metrics_run_name_step", "run_id", "name", "step"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    name: Mapped[str] = mapped_column(String(100), nullable=False)
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    value: Mapped[float] = mapped_column(Float, nullable=False)
    ts: Mapped[datetime] = _now()


class TrackerProgress(Base):
    """The newest policy version each experiment tracker of a run holds (W&B, MLflow, TensorBoard): what a
    trainer that opens the run again re-sends from, out of `metrics`."""

    __tablename__ = "tracker_progress"

    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    tracker: Mapped[str] = mapped_column(String(32), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    updated_at: Mapped[datetime] = _now()


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(String(200), nullable=False)
    token_sha256: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    scopes: Mapped[list[str]] = mapped_column(ARRAY(String(32)), nullable=False, default=list)  # read, write, admin
    created_at: Mapped[datetime] = _now()
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Job(Base):
    """Background (Celery) jobs the API triggers: dataset import, evaluation, export, retention."""

    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = _uuid_pk()
    kind: Mapped[str] = mapped_column(String(32), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="queued")  # queued|running|succeeded|failed
    params: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    result: Mapped[dict] = mapped_column(JSONB, nullable=False, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    run_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = _now()
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TrainSample(Base):
    """The trainer's own record of what it consumed from `results.accepted`: each (run, task, sample) once,
    with the policy version whose step used it (`status="used"`, `baseline` for ReMax's greedy sample) or why it
    was not trained on (stale, filtered, incomplete, excluded; `abandoned`: the controller announced the slot
    out of attempts). The primary key makes a second use of a sample impossible, even across restarts."""

    __tablename__ = "train_samples"

    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    task_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    sample_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    version: Mapped[int] = mapped_column(Integer, nullable=False)  # the policy version the step produced
    status: Mapped[str] = mapped_column(String(16), nullable=False)  # used | baseline | stale | filtered | incomplete | excluded | abandoned
    generated_version: Mapped[int | None] = mapped_column(Integer)  # oldest policy version in the sample
    batch_idx: Mapped[int | None] = mapped_column(Integer)  # with task_id, the sample's group
    created_at: Mapped[datetime] = _now()

