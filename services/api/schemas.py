"""What every route returns: one typed model per response (the OpenAPI's response schemas, and what the CLI
parses responses into). Lists are pages: `data` (this page) and `count` (all matches)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


class ErrorItem(BaseModel):
    field: str | None = Field(None, description="the input at fault, dotted (`algorithm.lr`, `query.limit`)")
    message: str = Field(..., description="what is wrong")
    hint: str | None = Field(None, description="how to fix it")


class ErrorBody(BaseModel):
    """The body of every error response."""

    message: str = Field(..., description="the problems in one line")
    detail: list[ErrorItem]


class Page(BaseModel, Generic[T]):
    data: list[T]
    count: int = Field(..., description="items matching the query (all pages)")


# ---- runs -------------------------------------------------------------------------------------------------


class RunPublic(BaseModel):
    id: uuid.UUID
    name: str
    kind: Literal["train", "eval", "tinker"] = Field(..., description="tinker: a LoRA training client of the "
                                                    "Tinker API (docs/tinker.md), not driven by the controller")
    status: str = Field(..., description="pending, running, paused, stopping, stopped, completed or failed")
    policy_version: int
    error: str | None = Field(None, description="why the run failed (set by the controller)")
    stall_reason: str | None = Field(None, description="why a running run makes no progress (detected by the "
                                     "controller after STALL_AFTER_S without an attempt ending or a new policy "
                                     "version; also 'paused: ...'); null while it progresses")
    stalled_since: datetime | None = Field(None, description="when the current stall began")
    warning: str | None = Field(None, description="progress that teaches nothing, e.g. a training run whose "
                                "groups carried no learning signal (equal rewards) for several versions in a row")
    summary: dict[str, Any]
    config: dict[str, Any] = Field(..., description="the RunConfig as stored (tinker runs: a TinkerRunConfig)")
    created_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime | None
    sandbox: str | None = Field(None, description="the mode the env runs model-written code under (env.args.sandbox:"
                                " namespaces, container or none); null when the env runs none")
    warnings: list[str] = Field(default_factory=list, description="what weakens this run, e.g. sandbox 'none'")


class UnitCounts(BaseModel):
    """(task, sample) units: completed + in_flight + retrying + errored + failed + cancelled = total."""

    total: int
    completed: int = Field(..., description="produced a scored result")
    in_flight: int
    retrying: int = Field(..., description="an attempt failed or was lost; another will be dispatched")
    errored: int = Field(0, description="the user's code failed (env, reward function, agent, workflow or agent "
                         "program raised, returned the wrong type or hung): not scored, not retried")
    failed: int = Field(..., description="out of attempts (or the run ended without finishing it)")
    cancelled: int = Field(..., description="unfinished when the run was stopped")


class AttemptCounts(BaseModel):
    """Dispatched attempts: completed + in_flight + errored + failed + lost + cancelled = total."""

    total: int
    completed: int
    in_flight: int
    errored: int = Field(0, description="ended with a user-code error")
    failed: int = Field(..., description="infrastructure failure")
    lost: int = Field(..., description="no result before the lease expired")
    cancelled: int


class ErrorReason(BaseModel):
    reason: str = Field(..., description="user-code errors: '<where>: <exception>'; failures: the error's last line")
    outcome: Literal["error", "failed", "lost"]
    attempts: int
    units: int


class Ledger(BaseModel):
    units: UnitCounts
    attempts: AttemptCounts
    requeued: int = Field(0, description="units that scored after a lost or failed attempt was re-run (counted "
                          "within units.completed)")
    top_reasons: list[ErrorReason] = Field(default_factory=list, description="why attempts ended unscored, most "
                                           "common first (the `run_error_reasons` view)")


class Progress(BaseModel):
    unit: Literal["steps", "samples"] = Field(..., description="optimizer steps (train with total_steps) or "
                                                             "(task, sample) units finished")
    done: int
    total: int | None = Field(..., description="null when unbounded or unknown")
    fraction: float | None


class MetricPoint(BaseModel):
    step: int
    value: float
    ts: datetime


class RunDetail(RunPublic):
    ledger: Ledger
    progress: Progress
    latest_metrics: dict[str, MetricPoint]
    pass_at_k: dict[str, float] | None = Field(None, description="eval runs: pass@1, pass@2, ...")
    outage: str | None = Field(None, description="live runs: why their numbers are frozen (a dependency is down)")
    tool_call_errors: int = Field(0, description="malformed tool calls the run's agents made (not JSON, unknown tool, "
                                  "wrong arguments): each was an error observation the agent saw, none ended an episode")
    context_rewrites: int = Field(0, description="turns after which an agent rewrote its history (summarized or dropped "
                                  "old turns): each starts a new training sequence of its trajectory")


class TrajectoryPublic(BaseModel):
    id: uuid.UUID
    run_id: uuid.UUID
    episode_id: uuid.UUID
    task_id: str
    sample_idx: int
    attempt: int
    traj_idx: int
    name: str
    reward: float
    termination_reason: str
    num_steps: int
    prompt_tokens: int
    response_tokens: int
    policy_version_min: int | None
    policy_version_max: int | None
    mismatch: bool
    created_at: datetime


class MetricSeries(BaseModel):
    run_id: uuid.UUID
    series: dict[str, list[MetricPoint]] = Field(..., description="metric name -> points by step")


class VersionReward(BaseModel):
    policy_version: int | None
    num_trajectories: int
    mean_reward: float | None
    pass_rate: float | None


class CheckpointPublic(BaseModel):
    version: int
    uri: str
    path: str | None
    sha256: str
    bytes: int
    metrics: dict[str, Any]
    status: str
    created_at: datetime


class RunEventPublic(BaseModel):
    id: int
    ts: datetime
    kind: str
    message: str
    data: dict[str, Any]


# ---- trajectories -----------------------------------------------------------------------------------------


class StepPublic(BaseModel):
    step_idx: int
    chat_completions: list[dict[str, Any]]
    observation: Any = None
    thought: str | None
    action: Any = None
    model_response: str | None
    reward: float
    done: bool
    mc_return: float | None
    info: dict[str, Any]
    weight_version: int | None
    prompt_tokens: int
    response_tokens: int
    gen_ms: float = Field(..., description="time generating this step's response, ms")
    env_ms: float = Field(..., description="time in the environment's step, ms")


class TokenArraysPublic(BaseModel):
    step_idx: int = Field(..., description="-1: the trajectory's assembled multi-turn stream")
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None
    loss_mask: list[int] | None
    versions: list[int] | None


class EpisodePublic(BaseModel):
    id: uuid.UUID
    status: str
    is_correct: bool | None
    reward: float | None
    termination_reason: str
    task: dict[str, Any]
    metrics: dict[str, Any]
    error: str | None
    worker_id: str | None


class Timeline(BaseModel):
    """One unit's life from what Postgres holds: the steps' gen_ms / env_ms fill the time between start and finish."""

    dispatched_at: datetime | None = Field(None, description="the controller dispatched the attempt (ledger)")
    started_at: datetime | None = Field(None, description="a rollout worker started the episode")
    finished_at: datetime | None = Field(None, description="the episode ended on the rollout worker")
    stored_at: datetime | None = Field(None, description="the store committed it")
    trace_id: str | None = Field(None, description="the unit's OpenTelemetry trace, when tracing was on")
    trace_url: str | None = Field(None, description="the trace in Jaeger, when JAEGER_UI_URL is set")


class TrajectoryDetail(TrajectoryPublic):
    info: dict[str, Any]
    uid: str | None
    steps: list[StepPublic]
    episode: EpisodePublic | None
    timeline: Timeline | None = None
    tokens: list[TokenArraysPublic] | None = Field(None, description="with include_tokens=true")


# ---- datasets, jobs, tokens, SQL, system ------------------------------------------------------------------


class DatasetPublic(BaseModel):
    # Fields the registry adds later (versions, ...) pass through rather than being cut from responses.
    model_config = ConfigDict(extra="allow")

    id: uuid.UUID
    name: str
    split: str
    source: str
    num_rows: int
    info: dict[str, Any]
    created_at: datetime | None


class DatasetDetail(BaseModel):
    name: str
    splits: dict[str, DatasetPublic]


class DatasetRowPublic(BaseModel):
    idx: int
    task_id: str
    data: dict[str, Any]


class DatasetRowsPage(Page[DatasetRowPublic]):
    name: str
    split: str
    version: int = Field(..., description="the dataset version these rows belong to")
    offset: int


class JobPublic(BaseModel):
    id: uuid.UUID
    kind: str
    status: str = Field(..., description="queued, running, succeeded or failed")
    params: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    run_id: uuid.UUID | None
    created_at: datetime | None
    finished_at: datetime | None


class TokenPublic(BaseModel):
    id: uuid.UUID
    name: str
    scopes: list[str]
    created_at: datetime
    revoked_at: datetime | None


class TokenCreated(TokenPublic):
    token: str = Field(..., description="the bearer token; shown once, only its sha256 is stored")


class SqlResult(BaseModel):
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool = Field(..., description="more rows matched than were returned")


class AgentSessionPublic(BaseModel):
    """An external agent program's session: call the model at `base_url` (OpenAI-compatible), then post
    {"reward": float, "info": {...}} to `reward_url` within `deadline_s`."""

    session_id: str
    base_url: str
    reward_url: str
    task: dict[str, Any]
    task_id: str
    sample_idx: int
    attempt: int
    deadline_s: float = Field(description="seconds left to post the reward; later, the episode ends as a timeout")


class ClaimRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a typo'd field or `"wait_s": false` is a 422

    wait_s: float = Field(10.0, ge=0, le=60, description="how long to wait for a session to come free, seconds")


class Health(BaseModel):
    status: Literal["ok"]
    service: str


class Readiness(BaseModel):
    ready: bool
    redis: bool
    postgres: bool
