"""The Celery app: Redis broker (REDIS_URL), one task per job kind (names in shared.clients.jobs), each wrapped so the
`jobs` row records running -> succeeded (result) | failed (error). Bad params fail the job without retry;
a worker that dies mid-job leaves the task unacknowledged, so another worker runs it again (acks_late). A job's
task delivered twice runs once: one delivery at a time holds the job (a Postgres advisory lock on its id) and a
finished job is not run again."""

from __future__ import annotations

import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta

from celery import Celery
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from services.jobs.settings import JobsSettings
from services.jobs.tasks import JOBS, JobContext, JobInputError
from services.jobs.tracking import sync_tracking
from shared.clients.jobs import JOB_TASKS
from shared.contracts.db.models import RUN_STATUSES, Job, Run
from shared.platform.db.session import make_engine
from shared.platform.logs import get_logger

log = get_logger(__name__)


def celery_broker_url(redis_url: str) -> str:
    """The Celery broker URL of REDIS_URL, so one REDIS_URL serves every component however it is started.
    kombu spells a unix-socket Redis `redis+socket:///path?virtual_host=N` and rejects redis-py's
    `unix:///path?db=N` ("No such transport: unix"), which is what the embedded Redis of the local stack gives;
    every other URL is the same for both."""
    if not redis_url.startswith("unix://"):
        return redis_url
    path, _, query = redis_url[len("unix://"):].partition("?")
    db = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("db", "0")
    return f"redis+socket://{path}?virtual_host={db}"


def celery_client(redis_url: str) -> Celery:
    """A Celery app that only sends tasks (the intake's), its broker REDIS_URL."""
    return Celery("flywheel-jobs-intake", broker=celery_broker_url(redis_url))


def make_celery(config: JobsSettings) -> Celery:
    app = Celery("flywheel-jobs", broker=celery_broker_url(config.redis_url))
    app.conf.update(
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        task_ignore_result=True, broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
        broker_transport_options={"visibility_timeout": 3600},
    )
    ctx = JobContext(config, make_engine(config.database_url))
    for kind, fn in {**JOBS, "sync_tracking": sync_tracking}.items():
        app.task(name=JOB_TASKS[kind])(_job_task(ctx, kind, fn))
    _add_periodic_tasks(app, ctx)
    if config.jobs_beat:
        app.conf.beat_schedule = _schedule(config)
    return app


def _job_task(ctx: JobContext, kind: str, fn: Callable) -> Callable[[str], None]:
    def run_job(job_id: str) -> None:
        # One delivery of a job runs at a time: the task can arrive twice (the intake sends it again when a request
        # is redelivered), and a second copy running beside the first would do the work twice. The lock is the
        # connection's, so a worker that dies lets the redelivered task (acks_late) take the job up.
        key = uuid.UUID(job_id).int & (2**63 - 1)
        with ctx.engine.connect() as lock:
            if not lock.execute(select(func.pg_try_advisory_lock(key))).scalar():
                log.info("job %s is running in another delivery; this one is dropped", job_id)
                return
            try:
                _run(ctx, kind, fn, uuid.UUID(job_id))
            finally:
                lock.execute(select(func.pg_advisory_unlock(key)))

    run_job.__name__ = f"run_{kind}"
    return run_job


def _run(ctx: JobContext, kind: str, fn: Callable, job_id: uuid.UUID) -> None:
    job = _start(ctx, job_id)
    if job is None:
        return
    try:
        result = fn(ctx, job)
    except JobInputError as e:
        _finish(ctx, job.id, "failed", result={"refused": e.reason}, error=str(e))
    except Exception as e:  # a failing job is recorded, never kills the worker
        log.error("job %s (%s) failed", job_id, kind, exc_info=True)
        _finish(ctx, job.id, "failed", error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}")
    else:
        _finish(ctx, job.id, "succeeded", result=result)


def _start(ctx: JobContext, job_id: uuid.UUID) -> Job | None:
    with Session(ctx.engine, expire_on_commit=False) as s:
        job = s.get(Job, job_id)
        if job is None:
            log.warning("job %s has no row; dropped", job_id)
            return None
        if job.status in ("succeeded", "failed"):
            return None  # a duplicate delivery of a finished job
        job.status = "running"
        s.commit()
        return job


def _finish(ctx: JobContext, job_id: uuid.UUID, status: str, result: dict | None = None, error: str | None = None):
    with Session(ctx.engine, expire_on_commit=False) as s:
        s.execute(update(Job).where(Job.id == job_id).values(
            status=status, result=result or {}, error=error, finished_at=func.now()))
        s.commit()


def _add_periodic_tasks(app: Celery, ctx: JobContext) -> None:
    @app.task(name="flywheel.scheduled")
    def scheduled(kind: str, params: dict) -> None:
        _run_scheduled(ctx, app, kind, params)

    @app.task(name="flywheel.sync_all_tracking")
    def sync_all_tracking() -> None:
        for run_id in active_run_ids(ctx):
            _run_scheduled(ctx, app, "sync_tracking", {"run_id": run_id})


def _run_scheduled(ctx: JobContext, app: Celery, kind: str, params: dict) -> None:
    """Periodic work gets a jobs row like API-triggered work, so it shows in GET /v1/jobs."""
    with Session(ctx.engine, expire_on_commit=False) as s:
        job = Job(kind=kind, status="queued", params=params, result={})
        s.add(job)
        s.commit()
        job_id = str(job.id)
    app.tasks[JOB_TASKS[kind]](job_id)


def _schedule(config: JobsSettings) -> dict:
    schedule = {"gc": {"task": "flywheel.scheduled", "schedule": timedelta(seconds=config.gc_interval_s),
                       "args": ("gc", {"keep_checkpoints": config.keep_checkpoints, "trim_streams": True})}}
    if config.wandb_project or config.mlflow_tracking_uri:
        schedule["tracking"] = {"task": "flywheel.sync_all_tracking",
                                "schedule": timedelta(seconds=config.tracking_interval_s)}
    return schedule


def active_run_ids(ctx: JobContext) -> list[str]:
    live = [s for s in RUN_STATUSES if s not in ("stopped", "completed", "failed")]
    with Session(ctx.engine, expire_on_commit=False) as s:
        return [str(r) for r in s.execute(select(Run.id).where(Run.status.in_(live))).scalars()]
