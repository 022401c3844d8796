"""How far a run is: the dispatched-task ledger, expected work, latest metrics and pass@k (eval runs)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from shared.db.models import EpisodeRow, Metric, Run, TrajectoryRow
from shared.ledger import ledger_summary
from shared.passk import pass_at_k as pass_at_k_one
from shared.run_config import RunConfig


def ledger(session: Session, run_id: uuid.UUID) -> dict[str, int]:
    """{dispatched (attempts), in_flight, completed, failed, lost, cancelled, finished} from the ledger."""
    return ledger_summary(session, run_id)


def expected_samples(config: dict[str, Any], num_rows: int | None) -> int | None:
    """Trajectories the run will have produced when it completes (None when unbounded or unknown)."""
    try:
        cfg = RunConfig.model_construct(**config)
        samples, tasks_per_batch = int(cfg.samples_per_task), int(cfg.tasks_per_batch)
    except (TypeError, ValueError):
        return None
    if cfg.kind == "train" and config.get("total_steps"):
        return int(config["total_steps"]) * tasks_per_batch * samples
    if num_rows is None:
        return None
    tasks = min(num_rows, int(config.get("max_tasks") or num_rows))
    return tasks * samples * int(config.get("epochs") or 1)


def stored_trajectories(session: Session, run_id: uuid.UUID) -> int:
    return session.execute(
        select(func.count(func.distinct(TrajectoryRow.episode_id))).where(TrajectoryRow.run_id == run_id)
    ).scalar_one()


def latest_metrics(session: Session, run_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    """Each metric's value at its highest step."""
    ranked = (
        select(Metric.name, Metric.step, Metric.value, Metric.ts,
               func.row_number().over(partition_by=Metric.name, order_by=(Metric.step.desc(), Metric.id.desc()))
               .label("rn"))
        .where(Metric.run_id == run_id).subquery()
    )
    rows = session.execute(select(ranked).where(ranked.c.rn == 1)).all()
    return {r.name: {"step": r.step, "value": r.value, "ts": r.ts.isoformat()} for r in rows}


def pass_at_k(session: Session, run_id: uuid.UUID, max_k: int | None = None) -> dict[str, float]:
    """Mean over tasks of pass@k for k = 1, 2, 4, ... up to the fewest samples any task has."""
    rows = session.execute(
        select(EpisodeRow.task_id, func.count(), func.count().filter(EpisodeRow.is_correct))
        .where(EpisodeRow.run_id == run_id, EpisodeRow.status == "completed").group_by(EpisodeRow.task_id)
    ).all()
    if not rows:
        return {}
    n_min = min(n for _, n, _ in rows)
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if k <= min(n_min, max_k or n_min)]
    return {f"pass@{k}": sum(pass_at_k_one(n, c, k) for _, n, c in rows) / len(rows) for k in ks}


def reward_by_version(session: Session, run_id: uuid.UUID) -> list[dict[str, Any]]:
    rows = session.execute(
        select(TrajectoryRow.policy_version_max.label("version"), func.count().label("n"),
               func.avg(TrajectoryRow.reward).label("mean_reward"),
               func.avg(case((EpisodeRow.is_correct, 1.0), else_=0.0)).label("pass_rate"))
        .join(EpisodeRow, EpisodeRow.id == TrajectoryRow.episode_id).where(TrajectoryRow.run_id == run_id).group_by(TrajectoryRow.policy_version_max)
        .order_by(TrajectoryRow.policy_version_max)
    ).all()
    return [{"policy_version": r.version, "num_trajectories": r.n, "mean_reward": r.mean_reward,
             "pass_rate": r.pass_rate} for r in rows]


def run_out(run: Run) -> dict[str, Any]:
    return {
        "id": str(run.id), "name": run.name, "kind": run.kind, "status": run.status,
        "policy_version": run.policy_version, "error": run.error, "summary": run.summary, "config": run.config,
        "created_at": _iso(run.created_at), "started_at": _iso(run.started_at),
        "finished_at": _iso(run.finished_at), "updated_at": _iso(run.updated_at),
    }


def _iso(ts) -> str | None:
    return ts.isoformat() if ts is not None else None
