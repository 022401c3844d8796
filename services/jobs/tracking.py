"""Optional experiment tracking: copies a run's metrics rows to W&B and/or MLflow. Off unless WANDB_PROJECT or
MLFLOW_TRACKING_URI is set; the client libraries are imported only then (neither is a dependency).

A cursor per (run, sink) in Redis (the highest metrics.id sent) makes each sync send only new rows."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.jobs.tasks import JobContext, JobInputError
from shared.contracts.db.models import Job, Metric, Run
from shared.contracts.streams import tracking_cursor_key
from shared.platform.bus import connect_sync


def _wandb_log(ctx: JobContext, run: Run, rows: list[Metric]) -> None:
    import wandb  # optional

    wb = wandb.init(project=ctx.config.wandb_project, id=str(run.id), name=run.name, resume="allow",
                    config=run.config, reinit=True)
    for m in rows:
        wb.log({m.name: m.value}, step=m.step)
    wb.finish()


def _mlflow_log(ctx: JobContext, run: Run, rows: list[Metric]) -> None:
    import mlflow  # optional

    mlflow.set_tracking_uri(ctx.config.mlflow_tracking_uri)
    with mlflow.start_run(run_name=f"{run.name}-{run.id}"):
        for m in rows:
            mlflow.log_metric(m.name, m.value, step=m.step)


def sinks(ctx: JobContext) -> dict[str, Any]:
    out = {}
    if ctx.config.wandb_project:
        out["wandb"] = _wandb_log
    if ctx.config.mlflow_tracking_uri:
        out["mlflow"] = _mlflow_log
    return out


def sync_tracking(ctx: JobContext, job: Job) -> dict[str, Any]:
    enabled = sinks(ctx)
    if not enabled:
        return {"skipped": "tracking is off: set WANDB_PROJECT or MLFLOW_TRACKING_URI on the jobs worker"}
    r = connect_sync(ctx.config.redis_url)
    run_id = uuid.UUID(job.params["run_id"])
    sent = {}
    with Session(ctx.engine, expire_on_commit=False) as s:
        run = s.get(Run, run_id)
        if run is None:
            raise JobInputError(f"run {run_id} does not exist")
        for name, log_rows in enabled.items():
            key = tracking_cursor_key(name, str(run_id))
            cursor = int(r.get(key) or 0)
            rows = s.execute(select(Metric).where(Metric.run_id == run_id, Metric.id > cursor)
                             .order_by(Metric.id)).scalars().all()
            if rows:
                log_rows(ctx, run, rows)
                r.set(key, rows[-1].id)
            sent[name] = len(rows)
    return {"sent": sent}
