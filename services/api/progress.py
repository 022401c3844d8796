"""How far a run is: the ledger in (task, sample) units and in attempts (the `run_ledger` view, so the API, the
CLI and SQL agree), progress, latest metrics and pass@k (eval runs)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import case, func, select, text
from sqlalchemy.orm import Session

from shared.contracts.db.models import EpisodeRow, Metric, Run, TrajectoryRow
from shared.contracts.passk import pass_at_k as pass_at_k_one

UNIT_COLUMNS = ("total", "completed", "in_flight", "retrying", "errored", "failed", "cancelled")
ATTEMPT_COLUMNS = ("total", "completed", "in_flight", "errored", "failed", "lost", "cancelled")


def ledger(session: Session, run_id: uuid.UUID, top: int = 5) -> dict[str, Any]:
    """{"units": {total, completed, in_flight, retrying, errored, failed, cancelled}, "attempts": {total,
    completed, in_flight, errored, failed, lost, cancelled}, "top_reasons": [...]}: each set's columns other
    than total add up to its total; `completed` units are the scored ones."""
    # run_ledger and run_error_reasons are views (migrations 0005, 0006, 0008), not models: read them as SQL.
    row = session.execute(text("SELECT * FROM run_ledger WHERE run_id = :r"), {"r": run_id}).mappings().first()
    row = row or {}
    reasons = session.execute(text(
        "SELECT reason, outcome, attempts, units FROM run_error_reasons WHERE run_id = :r "
        "ORDER BY attempts DESC, reason LIMIT :n"), {"r": run_id, "n": top}).mappings().all()
    return {"units": {c: int(row.get(f"units_{c}", 0)) for c in UNIT_COLUMNS},
            "attempts": {c: int(row.get(f"attempts_{c}", 0)) for c in ATTEMPT_COLUMNS},
            "requeued": int(row.get("units_requeued", 0)),
            "top_reasons": [dict(r) | {"reason": r["reason"] or r["outcome"]} for r in reasons]}


def progress(run: Run, units: dict[str, int], num_rows: int | None) -> dict[str, Any]:
    """Training runs with `total_steps` progress in optimizer steps (policy versions); other runs in
    (task, sample) units finished (completed or failed) out of those the run plans. Never above the total:
    replacement groups a training run dispatches for groups not trained on are work, not progress."""
    cfg = run.config
    if run.kind == "train" and cfg.get("total_steps"):
        done, total, unit = run.policy_version, int(cfg["total_steps"]), "steps"
    else:
        done = units["completed"] + units.get("errored", 0) + units["failed"]
        total, unit = planned_units(cfg, num_rows), "samples"
    if total is not None:
        done = min(done, total)
    return {"unit": unit, "done": done, "total": total, "fraction": done / total if total else None}


def planned_units(config: dict[str, Any], num_rows: int | None) -> int | None:
    """(task, sample) units an epoch-bounded run plans: tasks x samples_per_task x epochs (None if unknown)."""
    if num_rows is None:
        return None
    tasks = min(num_rows, int(config.get("max_tasks") or num_rows))
    return tasks * int(config.get("samples_per_task") or 1) * int(config.get("epochs") or 1)


def latest_metrics(session: Session, run_id: uuid.UUID) -> dict[str, dict[str, Any]]:
    """Each metric's value at its highest step."""
    ranked = (
        select(Metric.name, Metric.step, Metric.value, Metric.ts,
               func.row_number().over(partition_by=Metric.name, order_by=(Metric.step.desc(), Metric.id.desc()))
               .label("rn"))
        .where(Metric.run_id == run_id).subquery()
    )
    rows = session.execute(select(ranked).where(ranked.c.rn == 1)).all()
    return {r.name: {"step": r.step, "value": r.value, "ts": r.ts} for r in rows}


def trajectory_counts(session: Session, run_id: uuid.UUID) -> dict[str, int]:
    """Counts the rollout worker keeps per trajectory in its `info`, summed over the run: `tool_call_errors`
    (malformed tool calls of its agents) and `context_rewrites` (turns after which an agent rewrote its history)."""
    keys = ("tool_call_errors", "context_rewrites")
    totals = session.execute(select(*(func.coalesce(func.sum(TrajectoryRow.info[k].as_integer()), 0) for k in keys))
                             .where(TrajectoryRow.run_id == run_id)).one()
    return {k: int(v) for k, v in zip(keys, totals, strict=True)}


def pass_at_k(session: Session, run_id: uuid.UUID, max_k: int | None = None) -> dict[str, float]:
    """Mean over tasks of pass@k for k = 1, 2, 4, ... up to the fewest samples any task has, over the scored
    samples only (an errored sample is not a wrong answer: its count is in the ledger beside it)."""
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
    sandbox = ((run.config or {}).get("env") or {}).get("args", {}).get("sandbox")
    return {
        "id": str(run.id), "name": run.name, "kind": run.kind, "status": run.status,
        "policy_version": run.policy_version, "error": run.error, "stall_reason": run.stall_reason,
        "stalled_since": run.stalled_since, "warning": run.warning, "summary": run.summary, "config": run.config,
        "created_at": run.created_at, "started_at": run.started_at,
        "finished_at": run.finished_at, "updated_at": run.updated_at,
        "sandbox": sandbox, "warnings": [SANDBOX_NONE_WARNING] if sandbox == "none" else [],
    }


SANDBOX_NONE_WARNING = ("env.args.sandbox is 'none': model-written code runs without a kernel boundary (a Python "
                        "audit hook only, which the code can switch off); use it only for trusted code")
