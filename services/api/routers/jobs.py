"""Background jobs: status, list, and the jobs that are not about one resource (evaluation of a checkpoint,
retention/GC). Dataset import and run export are queued from their own resources."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field
from sqlalchemy import func, select

from services.api.deps import DB
from services.api.errors import ApiError, Int, StrictBody, errors, int_in
from services.api.job_queue import job_out, submit_job
from services.api.run_refs import resolve_run
from services.api.schemas import JobPublic, Page
from shared.contracts.db.models import Checkpoint, Job, Run
from shared.contracts.run_config import RunConfig

router = APIRouter(tags=["jobs"])


# `:uuid` so /jobs/gc is not taken for a job id (GET /v1/jobs/gc answers 405, not 422).
@router.get("/jobs/{job_id:uuid}", response_model=JobPublic, responses=errors(404, 422))
def show_job(job_id: uuid.UUID, session: DB) -> dict:
    job = session.get(Job, job_id)
    if job is None:
        raise ApiError(404, f"job {job_id} does not exist", field="job_id", hint="list jobs with GET /v1/jobs")
    return job_out(job)


@router.get("/jobs", response_model=Page[JobPublic], responses=errors(422))
def list_jobs(session: DB, kind: Literal["import_dataset", "delete_dataset", "evaluate", "export", "gc", "sync_tracking"] | None = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict:
    q = select(Job)
    if kind:
        q = q.where(Job.kind == kind)
    total = session.execute(select(func.count()).select_from(q.subquery())).scalar_one()
    jobs = session.execute(q.order_by(Job.created_at.desc()).limit(limit)).scalars()
    return {"data": [job_out(j) for j in jobs], "count": total}


class EvalRequest(StrictBody):
    """Evaluate a checkpoint (or `config.model` as given) on a dataset: the job creates an eval run."""

    config: RunConfig
    checkpoint_run_id: str | None = Field(None, min_length=1, max_length=200,
                                          description="run whose checkpoint replaces config.model: its id, a "
                                                      "unique prefix of its id, or its name")
    checkpoint_version: int_in(0, 2**31 - 1) | None = Field(None, description="default: the latest")  # type: ignore[valid-type]


@router.post("/evals", status_code=202, response_model=JobPublic, responses=errors(400, 404, 422, 503))
def evaluate(body: EvalRequest, request: Request, session: DB) -> dict:
    """Queue an evaluation job; its result names the eval run it created (poll GET /v1/jobs/{id})."""
    if body.checkpoint_run_id is not None:
        run_id = resolve_run(session, body.checkpoint_run_id, field="checkpoint_run_id")
        body.checkpoint_run_id = str(run_id)  # the job reads the run's id
        if session.get(Run, run_id) is None:
            raise ApiError(404, f"run {run_id} does not exist", field="checkpoint_run_id")
        q = select(Checkpoint.version).where(Checkpoint.run_id == run_id,
                                             Checkpoint.status == "available")
        if body.checkpoint_version is not None:
            q = q.where(Checkpoint.version == body.checkpoint_version)
        if session.execute(q.limit(1)).first() is None:
            raise ApiError(404, "no available checkpoint matches", field="checkpoint_version",
                           hint="list them with GET /v1/runs/{id}/checkpoints")
    params = body.model_dump(mode="json")
    params["config"]["kind"] = "eval"
    return submit_job(request, session, "evaluate", params)


class GcRequest(StrictBody):
    keep_checkpoints: Int = Field(3, ge=1, le=10_000, description="newest checkpoints kept per finished run")
    trim_streams: bool = Field(True, description="trim stream entries every group has acknowledged")


@router.post("/jobs/gc", status_code=202, response_model=JobPublic, responses=errors(400, 422, 503))
def collect_garbage(body: GcRequest, request: Request, session: DB) -> dict:
    return submit_job(request, session, "gc", body.model_dump())
