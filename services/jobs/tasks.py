"""The jobs themselves. Each takes the worker context and the job's params and returns the job's result
(a JSON object). Each is idempotent, since a job whose worker died is delivered again (acks_late)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from services.jobs.settings import JobsSettings
from shared.clients.run_commands import RunRefused, create_run
from shared.contracts import streams
from shared.contracts.db.models import (
    TERMINAL_RUN_STATUSES,
    Checkpoint,
    EpisodeRow,
    Job,
    Run,
    StepRow,
    TokenArrayRow,
    TrajectoryRow,
)
from shared.contracts.run_config import RunConfig
from shared.platform.bus import connect_sync
from shared.platform.logs import get_logger
from shared.stores.datasets import DatasetError, DatasetInUse, DatasetNotFound, DatasetRegistry, load_rows

log = get_logger(__name__)
TRIMMED_STREAMS = (streams.ROLLOUT_TASKS, streams.ENV_REQUESTS, streams.TRAJECTORIES, streams.RUN_COMMANDS,
                   streams.RUN_CONTROL, streams.JOB_REQUESTS)


class JobInputError(ValueError):
    """The job's params are wrong: recorded as the job's error, with `reason` (shared.clients.jobs.JOB_REFUSALS) as
    `result.refused`, never retried."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


@dataclass
class JobContext:
    config: JobsSettings
    engine: Engine


# ---- dataset import -----------------------------------------------------------------------------------------


def import_dataset(ctx: JobContext, job: Job) -> dict[str, Any]:
    """Store the rows as the next version of (name, split). A redelivered job finds the version it already
    made (tagged with its id) instead of adding another. An upload's file is removed once stored or refused."""
    p = job.params
    registry = DatasetRegistry(ctx.engine)
    made = next((v for v in registry.versions(p["name"], p.get("split", "train"))
                 if v["info"].get("job_id") == str(job.id)), None)
    if made is not None:
        return made
    try:
        if p.get("generator"):
            rows, source = _generated_rows(p["generator"], int(p.get("n", 100)), int(p.get("seed", 0)))
        else:
            rows, source = load_rows(p["path"], p.get("format")), f"file:{p['path']}"
        info = {"job_id": str(job.id)}
        if p.get("upload") is not None:
            source, info["format"] = f"upload:{p['upload']}", p.get("format")
        made = registry.register(p["name"], rows, p.get("split", "train"), source=source, info=info)
    except DatasetError as e:
        raise JobInputError(str(e)) from e
    finally:
        if p.get("upload") is not None:
            Path(p["path"]).unlink(missing_ok=True)
    return made


def delete_dataset(ctx: JobContext, job: Job) -> dict[str, Any]:
    """Delete one version, one split or every version of a dataset; refused while a run that has not ended
    reads any of them (in the transaction that deletes)."""
    p = job.params
    try:
        return {"deleted": DatasetRegistry(ctx.engine).delete(p["name"], p.get("split"), p.get("version"))}
    except DatasetNotFound as e:
        raise JobInputError(str(e), "not_found") from e
    except DatasetInUse as e:
        raise JobInputError(str(e), "in_use") from e


def _generated_rows(name: str, n: int, seed: int) -> tuple[list[dict], str]:
    try:
        from services.jobs.builtin_datasets import generate
    except ImportError as e:
        raise JobInputError("built-in dataset generators are not installed (services/jobs/builtin_datasets.py)") from e
    try:
        return list(generate(name, n, seed)), f"generator:{name}?n={n}&seed={seed}"
    except (KeyError, ValueError) as e:
        raise JobInputError(f"generator {name!r}: {e}") from e


# ---- evaluation of a checkpoint -----------------------------------------------------------------------------


def evaluate(ctx: JobContext, job: Job) -> dict[str, Any]:
    """Create an eval run (the controller creates and drives it). Its id is derived from the job's, and the
    controller creates a run id once, so a redelivered job finds its run instead of creating a second one."""
    if job.run_id is not None:
        return {"run_id": str(job.run_id)}
    config = dict(job.params["config"], kind="eval")
    with Session(ctx.engine, expire_on_commit=False) as s:
        if job.params.get("checkpoint_run_id"):
            ckpt = _checkpoint(s, job.params["checkpoint_run_id"], job.params.get("checkpoint_version"))
            config["model"] = ckpt.path or ckpt.uri
            config["name"] = f"{config['name']}@v{ckpt.version}"
        try:
            cfg = RunConfig.model_validate(config)
        except ValueError as e:
            raise JobInputError(f"run config: {e}") from e
        # The API's checks; a checkpoint's model is the weight server's path or URI, not this worker's to see.
        redis_client = connect_sync(ctx.config.redis_url, timeout_s=5)
        try:
            run_id, _ = create_run(s, redis_client, cfg, check_paths=ctx.config.check_model_paths
                                   and not job.params.get("checkpoint_run_id"), created_by=f"job {job.id}",
                                   run_id=uuid.uuid5(job.id, "eval run"))
        except RunRefused as e:
            raise JobInputError(str(e)) from e
        finally:
            redis_client.close()
        s.execute(update(Job).where(Job.id == job.id).values(run_id=run_id))
        s.commit()
        return {"run_id": str(run_id), "model": cfg.model}


def _checkpoint(s: Session, run_id: str, version: int | None) -> Checkpoint:
    q = select(Checkpoint).where(Checkpoint.run_id == uuid.UUID(run_id), Checkpoint.status == "available")
    q = q.where(Checkpoint.version == version) if version is not None else q.order_by(Checkpoint.version.desc())
    ckpt = s.execute(q.limit(1)).scalar_one_or_none()
    if ckpt is None:
        raise JobInputError(f"run {run_id} has no available checkpoint" + (f" v{version}" if version else ""))
    return ckpt


# ---- export to parquet --------------------------------------------------------------------------------------


def export_trajectories(ctx: JobContext, job: Job) -> dict[str, Any]:
    """One row per trajectory: summary columns, the steps as JSON text, and the assembled token arrays.
    Written to a temp file and renamed, so a reader never sees half a file. Load with
    `datasets.Dataset.from_parquet(path)`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run_id = uuid.UUID(job.params["run_id"])
    with Session(ctx.engine, expire_on_commit=False) as s:
        if s.get(Run, run_id) is None:
            raise JobInputError(f"run {run_id} does not exist")
        records = [_export_record(s, t, e) for t, e in s.execute(
            select(TrajectoryRow, EpisodeRow).join(EpisodeRow, EpisodeRow.id == TrajectoryRow.episode_id)
            .where(TrajectoryRow.run_id == run_id).order_by(TrajectoryRow.task_id, TrajectoryRow.sample_idx)
        ).all()]
    out_dir = ctx.config.resolved_exports_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"run-{run_id}-job-{job.id}.parquet"
    tmp = path.with_suffix(".parquet.tmp")
    table = pa.Table.from_pylist(records, schema=_export_schema())
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.rename(path)
    return {"path": str(path), "num_rows": len(records), "bytes": path.stat().st_size}


def _export_schema():
    import pyarrow as pa

    return pa.schema([
        ("trajectory_id", pa.string()), ("run_id", pa.string()), ("task_id", pa.string()),
        ("sample_idx", pa.int32()), ("attempt", pa.int32()), ("traj_idx", pa.int32()), ("name", pa.string()),
        ("reward", pa.float64()), ("is_correct", pa.bool_()), ("termination_reason", pa.string()),
        ("num_steps", pa.int32()), ("prompt_tokens", pa.int32()), ("response_tokens", pa.int32()),
        ("policy_version_min", pa.int32()), ("policy_version_max", pa.int32()), ("task", pa.string()),
        ("steps", pa.string()), ("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())), ("loss_mask", pa.list_(pa.int8())),
    ])


def _export_record(s: Session, t: TrajectoryRow, e: EpisodeRow) -> dict[str, Any]:
    steps = s.execute(select(StepRow).where(StepRow.trajectory_id == t.id).order_by(StepRow.step_idx)).scalars()
    tokens = s.get(TokenArrayRow, (t.id, -1))
    return {
        "trajectory_id": str(t.id), "run_id": str(t.run_id), "task_id": t.task_id, "sample_idx": t.sample_idx,
        "attempt": t.attempt, "traj_idx": t.traj_idx, "name": t.name, "reward": t.reward,
        "is_correct": e.is_correct, "termination_reason": t.termination_reason, "num_steps": t.num_steps,
        "prompt_tokens": t.prompt_tokens, "response_tokens": t.response_tokens,
        "policy_version_min": t.policy_version_min, "policy_version_max": t.policy_version_max,
        "task": json.dumps(e.task), "steps": json.dumps([_step_record(st) for st in steps]),
        "prompt_ids": tokens.prompt_ids if tokens else [], "response_ids": tokens.response_ids if tokens else [],
        "logprobs": tokens.logprobs if tokens else [], "loss_mask": (tokens.loss_mask or []) if tokens else [],
    }


def _step_record(st: StepRow) -> dict[str, Any]:
    return {"step_idx": st.step_idx, "chat_completions": st.chat_completions, "observation": st.observation,
            "action": st.action, "model_response": st.model_response, "reward": st.reward, "done": st.done}


# ---- retention ----------------------------------------------------------------------------------------------


def gc(ctx: JobContext, job: Job) -> dict[str, Any]:
    keep = int(job.params.get("keep_checkpoints", ctx.config.keep_checkpoints))
    result = _gc_checkpoints(ctx, keep)
    if job.params.get("trim_streams", True):
        result["trimmed"] = asyncio.run(_trim_streams(ctx.config.redis_url))
    return result


def _gc_checkpoints(ctx: JobContext, keep: int) -> dict[str, Any]:
    """Of each finished run keep the newest `keep` checkpoints. The weight server owns them (their files and
    rows), so it deletes the rest, keeping any snapshot or delta a kept version is built on."""
    with Session(ctx.engine) as s:
        finished = select(Run.id).where(Run.status.in_(TERMINAL_RUN_STATUSES))
        runs = s.execute(select(Checkpoint.run_id).where(Checkpoint.run_id.in_(finished),
                                                         Checkpoint.status == "available")
                         .group_by(Checkpoint.run_id).having(func.count() > keep)).scalars().all()
    deleted = []
    with httpx.Client(base_url=ctx.config.weight_server_url, timeout=60) as http:
        for run_id in runs:
            try:
                r = http.post(f"/v1/runs/{run_id}/versions/retain", json={"keep_last": keep})
                r.raise_for_status()
            except httpx.HTTPError as e:
                raise RuntimeError(f"the weight server at {ctx.config.weight_server_url} did not delete run "
                                   f"{run_id}'s older checkpoints: {e} (WEIGHT_SERVER_URL names it)") from e
            deleted += [f"{run_id}/v{v}" for v in r.json()["deleted"]]
    return {"deleted_checkpoints": deleted}


async def _trim_streams(redis_url: str) -> dict[str, int]:
    from shared.platform.bus import StreamBus, connect

    redis = connect(redis_url)
    try:
        bus = StreamBus(redis)
        return {name: await bus.trim_acknowledged(name) for name in TRIMMED_STREAMS}
    finally:
        await redis.aclose()


JOBS = {"import_dataset": import_dataset, "delete_dataset": delete_dataset, "evaluate": evaluate, "export": export_trajectories, "gc": gc}
