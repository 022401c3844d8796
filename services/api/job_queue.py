"""Asking the jobs service for a job (shared.clients.jobs.request_job: it stores the `queued` row and sends the task, so
the API writes no `jobs` row), and waiting for one to finish."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from services.api.errors import ApiError
from shared.clients.jobs import JobsUnavailable, request_job
from shared.contracts.db.models import Job
from shared.platform.bus import RedisError


def submit_job(request: Request, session: Session, kind: str, params: dict[str, Any],
               run_id: uuid.UUID | None = None) -> dict:
    """The job as queued; 503 when no jobs service stored it in JOB_REQUEST_WAIT_S (nothing was queued)."""
    try:
        job_id = request_job(session, request.app.state.redis, kind, params, run_id=run_id,
                             wait_s=request.app.state.config.job_request_wait_s)
    except JobsUnavailable as e:
        raise ApiError(503, str(e), hint="the jobs service (`flywheel-jobs`) stores and runs jobs") from e
    except RedisError as e:
        raise ApiError(503, f"the job queue (Redis) is unreachable: {e}", hint="retry once Redis is back") from e
    session.rollback()  # a fresh snapshot: the row was committed by the jobs service after this session began
    return job_out(session.get(Job, job_id))


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
