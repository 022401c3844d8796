"""Submitting background jobs: a `jobs` row first (so the job is visible even before a worker takes it),
then the Celery task by name (services/jobs runs it; the API never imports that package); waiting for one."""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from services.api.errors import ApiError
from shared.db.models import Job
from shared.jobs import JOB_TASKS, celery_broker_url


def job_queue(redis_url: str) -> Celery:
    """The Celery client jobs are sent with; its broker is REDIS_URL (a unix:// one translated for kombu)."""
    return Celery("flywheel-api", broker=celery_broker_url(redis_url))


def submit_job(session: Session, celery, kind: str, params: dict[str, Any], run_id: uuid.UUID | None = None) -> dict:
    job = Job(kind=kind, status="queued", params=params, result={}, run_id=run_id)
    session.add(job)
    session.commit()
    try:
        celery.send_task(JOB_TASKS[kind], args=[str(job.id)], task_id=str(job.id))
    except OperationalError as e:
        session.execute(update(Job).where(Job.id == job.id).values(status="failed", error=f"broker: {e}"))
        session.commit()
        raise ApiError(503, f"the job queue (Redis) is unreachable: {e}", hint="retry once Redis is back") from e
    return job_out(job)


def job_out(job: Job) -> dict[str, Any]:
    return {
        "id": str(job.id), "kind": job.kind, "status": job.status, "params": job.params, "result": job.result,
        "error": job.error, "run_id": str(job.run_id) if job.run_id else None,
        "created_at": job.created_at.isoformat() if job.created_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
    }


def wait_for_job(engine: Engine, job_id: str, timeout_s: float) -> Job:
    """The job once it has succeeded or failed, or as it stands after `timeout_s` (still queued or running: the
    caller answers 202 with it)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    with Session(engine, expire_on_commit=False) as s:
        while True:
            job = s.get(Job, uuid.UUID(job_id), populate_existing=True)
            if job.status in ("succeeded", "failed") or time.monotonic() >= deadline:
                return job
            s.rollback()  # a fresh snapshot for the next look
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.25)
