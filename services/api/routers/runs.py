"""Runs: create (training or evaluation), list, show, pause/resume/stop, and the run's data: trajectories,
metrics, checkpoints, events, reward by policy version, export."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from sqlalchemy import func, select

from services.api.deps import DB, Config
from services.api.errors import ApiError, errors, refused
from services.api.job_queue import submit_job
from services.api.progress import (
    latest_metrics,
    ledger,
    pass_at_k,
    progress,
    reward_by_version,
    run_out,
    trajectory_counts,
)
from services.api.routers.system import dependency_outage
from services.api.run_refs import RunId
from services.api.schemas import (
    CheckpointPublic,
    JobPublic,
    MetricSeries,
    Page,
    RunDetail,
    RunEventPublic,
    RunPublic,
    TrajectoryPublic,
    VersionReward,
)
from shared.clients.run_commands import ControllerUnavailable, RunRefused, run_command
from shared.clients.run_commands import create_run as add_run
from shared.contracts.db.models import (
    RUN_STATUSES,
    TERMINAL_RUN_STATUSES,
    Checkpoint,
    Metric,
    Run,
    RunEvent,
    TrajectoryRow,
)
from shared.contracts.messages.control import Action
from shared.contracts.run_config import RunConfig
from shared.platform.bus import RedisError
from shared.sdk.types import TerminationReason
from shared.stores.datasets import count_rows

# 400 on every route: a run reference (name, id prefix) that matches several runs (services/api/run_refs.py).
router = APIRouter(prefix="/runs", tags=["runs"], responses=errors(400))
INT32 = 2**31 - 1
Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=INT32)]
RunStatus = Literal[RUN_STATUSES]  # type: ignore[valid-type]


ON_RUN = errors(404, 422)


def get_run(session, run_id: uuid.UUID) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise ApiError(404, f"run {run_id} does not exist", field="run_id", hint="list runs with GET /v1/runs")
    return run


@router.post("", status_code=201, response_model=RunPublic, responses=errors(400, 404, 409, 422, 503))
def create_run(cfg: RunConfig, request: Request, session: DB, config: Config) -> dict:
    """Start a training or evaluation run (`kind`). The controller creates it `pending` and drives it. The run
    reads one dataset version for its whole life: `dataset_version`, or the latest at creation (recorded).

    Refused before anything is stored: 404 when the dataset (version) does not exist; 400 when the model cannot
    work as given (a local path that does not exist, a relative path that is no folder and no hub id, token
    budgets beyond the model's context, an engine no live rollout worker offers, dataset rows without a field
    the env needs); 503, with nothing created, when no controller answers in time."""
    try:
        with commanding():
            run_id, _ = add_run(session, request.app.state.redis, cfg, check_paths=config.check_model_paths,
                                wait_s=config.run_command_wait_s)
    except RunRefused as e:
        raise refused(e) from e
    return run_out(get_run(session, run_id))


@contextlib.contextmanager
def commanding() -> Iterator[None]:
    """A run command that could not reach a controller: 503, saying that nothing changed."""
    try:
        yield
    except ControllerUnavailable as e:
        raise ApiError(503, str(e)) from e
    except RedisError as e:
        raise ApiError(503, f"Redis is unreachable, so the command could not be sent to the controller ({e})",
                       hint="retry once Redis is back") from e


@router.get("", response_model=Page[RunPublic], responses=errors(422))
def list_runs(session: DB, status: RunStatus | None = None, kind: Literal["train", "eval", "tinker"] | None = None,
              limit: Limit = 50, offset: Offset = 0) -> dict:
    q = select(Run)
    if status:
        q = q.where(Run.status == status)
    if kind:
        q = q.where(Run.kind == kind)
    total = session.execute(select(func.count()).select_from(q.subquery())).scalar_one()
    runs = session.execute(q.order_by(Run.created_at.desc()).limit(limit).offset(offset)).scalars()
    return {"data": [run_out(r) for r in runs], "count": total}


@router.get("/{run_id}", response_model=RunDetail, responses=ON_RUN)
def show_run(run_id: RunId, request: Request, session: DB) -> dict:
    """Status (and `error` when it failed), the ledger in units and attempts, progress, current policy version,
    latest metrics (and pass@k for evals)."""
    run = get_run(session, run_id)
    cfg = run.config
    num_rows = count_rows(request.app.state.engine, cfg.get("dataset", ""), cfg.get("dataset_split", "train"),
                          cfg.get("dataset_version"))
    counts = ledger(session, run_id)
    out = run_out(run) | {
        "ledger": counts, "latest_metrics": latest_metrics(session, run_id),
        "progress": progress(run, counts["units"], num_rows), **trajectory_counts(session, run_id),
    }
    if run.kind == "eval":
        out["pass_at_k"] = pass_at_k(session, run_id, cfg.get("samples_per_task"))
    if run.status not in TERMINAL_RUN_STATUSES and (outage := dependency_outage(request)):
        out["outage"] = outage  # a live run whose numbers are frozen says why
    return out


def _control(request: Request, session, run_id: uuid.UUID, action: Action, config) -> dict:
    """Ask the controller (a `RunCommand` on `run.commands`) and answer with what it did: the new status, 409
    when the run is in no status the action starts from (shared/contracts/messages/control.py TRANSITIONS), 503 when no
    controller answered (nothing changed). The controller then tells the trainer on `run.control`."""
    get_run(session, run_id)
    with commanding():
        reply = run_command(session, request.app.state.redis, run_id, action, wait_s=config.run_command_wait_s)
    if reply.outcome == "refused":
        raise ApiError(409, reply.message)
    session.expire_all()  # the controller changed the row (or found none, `not_found`: get_run's 404): read it again
    return run_out(get_run(session, run_id))


CONTROL = errors(404, 409, 422, 503)


@router.post("/{run_id}/pause", response_model=RunPublic, responses=CONTROL)
def pause_run(run_id: RunId, request: Request, session: DB, config: Config) -> dict:
    return _control(request, session, run_id, "pause", config)


@router.post("/{run_id}/resume", response_model=RunPublic, responses=CONTROL)
def resume_run(run_id: RunId, request: Request, session: DB, config: Config) -> dict:
    return _control(request, session, run_id, "resume", config)


@router.post("/{run_id}/stop", response_model=RunPublic, responses=CONTROL)
def stop_run(run_id: RunId, request: Request, session: DB, config: Config) -> dict:
    """Graceful stop: the run goes to `stopping`; the controller finishes or cancels in-flight work."""
    return _control(request, session, run_id, "stop", config)


@router.get("/{run_id}/trajectories", response_model=Page[TrajectoryPublic], responses=ON_RUN)
def list_trajectories(
    run_id: RunId, session: DB, policy_version: Annotated[int | None, Query(ge=0, le=INT32)] = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    termination_reason: TerminationReason | None = None, task_id: Annotated[str | None, Query(max_length=200)] = None,
    limit: Limit = 50, offset: Offset = 0,
) -> dict:
    """Trajectories of a run, newest first. `policy_version` matches trajectories generated (partly) by it."""
    get_run(session, run_id)
    q = select(TrajectoryRow).where(TrajectoryRow.run_id == run_id)
    if policy_version is not None:
        q = q.where(TrajectoryRow.policy_version_min <= policy_version,
                    TrajectoryRow.policy_version_max >= policy_version)
    if min_reward is not None:
        q = q.where(TrajectoryRow.reward >= min_reward)
    if max_reward is not None:
        q = q.where(TrajectoryRow.reward <= max_reward)
    if termination_reason is not None:
        q = q.where(TrajectoryRow.termination_reason == termination_reason.value)
    if task_id is not None:
        q = q.where(TrajectoryRow.task_id == task_id)
    total = session.execute(select(func.count()).select_from(q.subquery())).scalar_one()
    rows = session.execute(q.order_by(TrajectoryRow.created_at.desc(), TrajectoryRow.id).limit(limit)
                           .offset(offset)).scalars()
    return {"data": [trajectory_out(t) for t in rows], "count": total}


def trajectory_out(t: TrajectoryRow) -> dict:
    return {
        "id": str(t.id), "run_id": str(t.run_id), "episode_id": str(t.episode_id), "task_id": t.task_id,
        "sample_idx": t.sample_idx, "attempt": t.attempt, "traj_idx": t.traj_idx, "name": t.name,
        "reward": t.reward, "termination_reason": t.termination_reason, "num_steps": t.num_steps,
        "prompt_tokens": t.prompt_tokens, "response_tokens": t.response_tokens,
        "policy_version_min": t.policy_version_min, "policy_version_max": t.policy_version_max,
        "mismatch": t.mismatch, "created_at": t.created_at,
    }


@router.get("/{run_id}/metrics", response_model=MetricSeries, responses=ON_RUN)
def run_metrics(run_id: RunId, session: DB,
                name: Annotated[list[str], Query(max_length=100, default_factory=list)],
                since_step: Annotated[int, Query(ge=0, le=INT32)] = 0,
                limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000) -> dict:
    """Time series by metric name: [{step, value, ts}], step = policy version for training metrics."""
    get_run(session, run_id)
    q = select(Metric).where(Metric.run_id == run_id, Metric.step >= since_step)
    if name:
        q = q.where(Metric.name.in_(name))
    series: dict[str, list] = {}
    for m in session.execute(q.order_by(Metric.name, Metric.step, Metric.id).limit(limit)).scalars():
        series.setdefault(m.name, []).append({"step": m.step, "value": m.value, "ts": m.ts})
    return {"run_id": str(run_id), "series": series}


@router.get("/{run_id}/rewards", response_model=Page[VersionReward], responses=ON_RUN)
def run_rewards(run_id: RunId, session: DB) -> dict:
    """Mean reward and count of trajectories per policy version (what `flywheel runs watch` prints)."""
    get_run(session, run_id)
    items = reward_by_version(session, run_id)
    return {"data": items, "count": len(items)}


@router.get("/{run_id}/checkpoints", response_model=Page[CheckpointPublic], responses=ON_RUN)
def run_checkpoints(run_id: RunId, session: DB) -> dict:
    get_run(session, run_id)
    rows = session.execute(select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.version))
    items = [{"version": c.version, "uri": c.uri, "path": c.path, "sha256": c.sha256, "bytes": c.bytes,
              "metrics": c.metrics, "status": c.status, "created_at": c.created_at} for c in rows.scalars()]
    return {"data": items, "count": len(items)}


@router.get("/{run_id}/events", response_model=Page[RunEventPublic], responses=ON_RUN)
def run_events(run_id: RunId, session: DB, after_id: Annotated[int, Query(ge=0, le=2**62)] = 0,
               limit: Limit = 100) -> dict:
    """Events in order; poll with `after_id` = the last id seen."""
    get_run(session, run_id)
    q = select(RunEvent).where(RunEvent.run_id == run_id, RunEvent.id > after_id)
    total = session.execute(select(func.count()).select_from(q.subquery())).scalar_one()
    items = [{"id": e.id, "ts": e.ts, "kind": e.kind, "message": e.message, "data": e.data}
             for e in session.execute(q.order_by(RunEvent.id).limit(limit)).scalars()]
    return {"data": items, "count": total}


@router.post("/{run_id}/export", status_code=202, response_model=JobPublic, responses=errors(404, 422, 503))
def export_run(run_id: RunId, request: Request, session: DB, config: Config) -> dict:
    """Queue an export of the run's trajectories to parquet (a job; poll GET /v1/jobs/{id})."""
    get_run(session, run_id)
    return submit_job(request, session, "export", {"run_id": str(run_id)}, run_id=run_id)
