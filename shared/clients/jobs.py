"""Background jobs: their kinds and Celery task names, and how one is asked for.

The jobs service is the one writer of `jobs`. A caller (the API) sends a `JobRequest` on `jobs.requests`
(`request_job`); the service's intake stores it as the job's `queued` row, under the id the caller chose, sends
the Celery task by name and answers (shared/contracts/messages/jobs.py). Its workers then record running -> succeeded
(result) | failed (error). A job refused for its input records why in `result.refused` (JOB_REFUSALS) beside
its error message. Every task takes one argument, the job id; its parameters are in `jobs.params`."""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from shared.contracts.db.models import Job
from shared.contracts.messages import JobRequest, JobRequestReply
from shared.contracts.streams import JOB_REQUESTS, job_reply
from shared.platform.bus import SyncRedis, ask

JOB_TASKS: dict[str, str] = {
    # params: name, split, path | generator (+ n, seed), format; `upload` (the file's name): the API's upload,
    # a file it wrote under DATA_DIR/uploads, removed once imported or refused
    "import_dataset": "flywheel.import_dataset",
    "delete_dataset": "flywheel.delete_dataset",  # params: name, split?, version?; result: deleted (versions)
    "evaluate": "flywheel.evaluate",  # params: config (RunConfig JSON), checkpoint_run_id?, checkpoint_version?
    "export": "flywheel.export_trajectories",  # params: run_id; result: path of a parquet file
    "gc": "flywheel.gc",  # params: keep_checkpoints, trim_streams
    "sync_tracking": "flywheel.sync_tracking",  # params: run_id; pushes metrics to W&B / MLflow when enabled
}
JOB_STATUSES = ("queued", "running", "succeeded", "failed")
JOB_REFUSALS = ("invalid", "not_found", "in_use")
REQUEST_WAIT_S = 10.0  # how long a sender waits for the jobs service to store a job, seconds


class JobsUnavailable(Exception):
    """No jobs service stored the job before its request expired: nothing was queued (the intake does not store
    a request it reads after `expires_at`)."""


def request_job(session: Session, redis_client: SyncRedis, kind: str, params: dict[str, Any], *,
                run_id: uuid.UUID | None = None, wait_s: float = REQUEST_WAIT_S) -> uuid.UUID:
    """Ask the jobs service for a job and wait until it is queued; its id (GET /v1/jobs/{id} follows it).

    The request expires `wait_s` after it is sent; this waits bus.ANSWER_GRACE_S longer, so the answer of an intake
    that read it in time still arrives. Without one, the database says whether the job was stored anyway: the
    answer never reports a job that does not exist, nor hides one that does. JobsUnavailable when it was not
    stored; RedisError when the request could not be sent."""
    if kind not in JOB_TASKS:
        raise ValueError(f"unknown job kind {kind!r}: one of {', '.join(JOB_TASKS)}")
    now, job_id = time.time(), uuid.uuid4()
    req = JobRequest(job_id=str(job_id), kind=kind, params=params, run_id=str(run_id) if run_id else None,
                     sent_at=now, expires_at=now + wait_s)
    answer = ask(redis_client, JOB_REQUESTS, req, job_reply(req.job_id), JobRequestReply, wait_s)
    stored = answer is not None and answer.outcome == "queued"
    if not stored and not session.execute(select(exists().where(Job.id == job_id))).scalar():
        raise JobsUnavailable(
            f"no jobs service took the {kind} job within {wait_s:g} s, so nothing was queued; start one "
            "(`make up` and `docker compose up` do) or check its log, then retry")
    return job_id
