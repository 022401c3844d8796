"""Background jobs: status, list, and the jobs that are not about one resource (evaluation of a checkpoint,
retention/GC). Dataset import and run export are queued from their own resources."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, Field
from sqlalchemy import select

from services.api.deps import DB
from services.api.job_queue import job_out, submit_job
from shared.db.models import Checkpoint, Job, Run
from shared.run_config import RunConfig

router = APIRouter(tags=["jobs"])


@router.get("/jobs/{job_id}")
def show_job(job_id: uuid.UUID, session: DB) -> dict:
    job = session.get(Job, job_id)
    if job is None:
        raise HTTPException(404, f"job {job_id} does not exist")
    return job_out(job)


@router.get("/jobs")
def list_jobs(session: DB, kind: Literal["import_dataset", "evaluate", "export", "gc", "sync_tracking"] | None = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict:
    q = select(Job).order_by(Job.created_at.desc()).limit(limit)
    if kind:
        q = q.where(Job.kind == kind)
    return {"items": [job_out(j) for j in session.execute(q).scalars()]}


class EvalRequest(BaseModel):
    """Evaluate a checkpoint (or `config.model` as given) on a dataset: the job creates an eval run."""

    config: RunConfig
    checkpoint_run_id: uuid.UUID | None = Field(None, description="run whose checkpoint replaces config.model")
    checkpoint_version: int | None = Field(None, ge=0, le=2**31 - 1, description="default: the latest")


@router.post("/evals", status_code=202)
def evaluate(body: EvalRequest, request: Request, session: DB) -> dict:
    if body.checkpoint_run_id is not None:
        if session.get(Run, body.checkpoint_run_id) is None:
            raise HTTPException(404, f"checkpoint_run_id: run {body.checkpoint_run_id} does not exist")
        q = select(Checkpoint.version).where(Checkpoint.run_id == body.checkpoint_run_id,
                                             Checkpoint.status == "available")
        if body.checkpoint_version is not None:
            q = q.where(Checkpoint.version == body.checkpoint_version)
        if session.execute(q.limit(1)).first() is None:
            raise HTTPException(404, "checkpoint_version: no available checkpoint matches")
    params = body.model_dump(mode="json")
    params["config"]["kind"] = "eval"
    return submit_job(session, request.app.state.celery, "evaluate", params)


class GcRequest(BaseModel):
    keep_checkpoints: int = Field(3, ge=1, le=10_000, description="newest checkpoints kept per finished run")
    trim_streams: bool = Field(True, description="trim stream entries every group has acknowledged")


@router.post("/jobs/gc", status_code=202)
def collect_garbage(body: GcRequest, request: Request, session: DB) -> dict:
    return submit_job(session, request.app.state.celery, "gc", body.model_dump())
