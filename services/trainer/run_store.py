"""Postgres side of the trainer: which runs to train (`runs`), its lease on them (`trainer_leases`,
shared/platform/leases.py), and its own durable record (`train_samples`, metrics, tracker progress). Of the controller's tables it reads only
`runs` (config, status): what it trains on arrives on `results.accepted`, and what the controller needs from it
leaves on `trainer.progress` (and which runs it trains, in its heartbeat). A user's stop arrives on `run.control`
(loop.py); the runs' status read here is how every other change, and a lost command, arrives."""

from __future__ import annotations

import uuid

from sqlalchemy import Engine, delete, func, select, text
from sqlalchemy.dialects.postgresql import insert

from services.trainer.state import SampleRecord, StepRecord
from shared.contracts.db.models import Checkpoint, Metric, Run, TrackerProgress, TrainSample
from shared.contracts.messages import ConsumedGroup
from shared.platform import leases

ACTIVE = ("running", "paused")  # a paused run keeps training on what already arrived
USED = ("used", "baseline")  # samples a step trained on (the greedy baseline only as a baseline)
DOOMING = ("excluded", "abandoned")  # a group with such a sample can never complete


class RunRow:
    def __init__(self, row):
        self.id, self.kind, self.status = str(row.id), row.kind, row.status
        self.config = row.config

    @property
    def trainable(self) -> bool:
        return self.kind == "train" and self.status in ACTIVE


def ping(db: Engine) -> None:
    """Raises (DB_DOWN) while Postgres does not answer."""
    with db.connect() as c:
        c.execute(text("SELECT 1"))


def load_run(db: Engine, run_id: str) -> RunRow | None:
    with db.connect() as c:
        row = c.execute(select(Run).where(Run.id == uuid.UUID(run_id))).first()
    return RunRow(row) if row else None


def active_runs(db: Engine) -> list[RunRow]:
    with db.connect() as c:
        rows = c.execute(select(Run).where(Run.kind == "train", Run.status.in_(ACTIVE))).all()
    return [RunRow(r) for r in rows]


def hold_leases(db: Engine, owner: str, run_ids: list[str], ttl_s: float) -> set[str]:
    """Take or renew this process's trainer lease on each run; returns those it holds."""
    with db.begin() as c:
        return leases.acquire(c, leases.TRAINER, owner, run_ids, ttl_s)


def unheld_tinker_models(db: Engine, owner: str) -> dict[str, str]:
    """Running tinker runs whose trainer lease is free or expired (their holder died or let go): model id ->
    run id."""
    with db.connect() as c:
        rows = c.execute(select(Run.id, Run.config["model_id"].astext).where(
            Run.kind == "tinker", Run.status == "running")).all()
        free = set(leases.free_or_ours(c, leases.TRAINER, owner, [str(r[0]) for r in rows]))
    return {model_id: str(run_id) for run_id, model_id in rows if str(run_id) in free}


def release_leases(db: Engine, owner: str, run_ids: list[str] | None = None) -> None:
    with db.begin() as c:
        leases.release(c, leases.TRAINER, owner, run_ids)


def consumed(db: Engine, run_id: str, keys: list[tuple[str, int, int]]) -> set[tuple[str, int]]:
    """(task_id, sample_idx) among `keys` that this trainer already recorded (used, dropped, excluded)."""
    tasks = list({k[0] for k in keys})
    with db.connect() as c:
        rows = c.execute(select(TrainSample.task_id, TrainSample.sample_idx).where(
            TrainSample.run_id == uuid.UUID(run_id), TrainSample.task_id.in_(tasks))).all()
    return {tuple(r) for r in rows}


def commit_step(db: Engine, record: StepRecord) -> None:
    """One transaction: which samples the step consumed and the step's metrics. Idempotent, so recovery can
    replay it from the checkpoint's STEP.json."""
    run = uuid.UUID(record.run_id)
    with db.begin() as c:
        if record.samples:
            c.execute(insert(TrainSample).values([
                dict(run_id=run, version=record.version, **s.model_dump()) for s in record.samples
            ]).on_conflict_do_nothing())
        c.execute(delete(Metric).where(Metric.run_id == run, Metric.step == record.version))
        if record.metrics:
            c.execute(insert(Metric).values([
                dict(run_id=run, name=k, step=record.version, value=float(v)) for k, v in record.metrics.items()
            ]))


def tracked_versions(db: Engine, run_id: str) -> dict[str, int]:
    """Tracker kind -> the newest policy version it logged (a kind not listed logged none)."""
    with db.connect() as c:
        rows = c.execute(select(TrackerProgress.tracker, TrackerProgress.version)
                         .where(TrackerProgress.run_id == uuid.UUID(run_id))).all()
    return dict(rows)


def record_tracked(db: Engine, run_id: str, tracker: str, version: int) -> None:
    stmt = insert(TrackerProgress).values(run_id=uuid.UUID(run_id), tracker=tracker, version=version)
    with db.begin() as c:
        c.execute(stmt.on_conflict_do_update(index_elements=["run_id", "tracker"],
                                             set_={"version": version, "updated_at": func.now()}))


def step_metrics(db: Engine, run_id: str, after: int) -> dict[int, dict[str, float]]:
    """Each committed version's metrics past `after`, by version (what trackers re-send)."""
    with db.connect() as c:
        rows = c.execute(select(Metric.step, Metric.name, Metric.value).where(
            Metric.run_id == uuid.UUID(run_id), Metric.step > after).order_by(Metric.step)).all()
    out: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        out.setdefault(step, {})[name] = value
    return out


def record_dropped(db: Engine, run_id: str, version: int, samples: list[SampleRecord]) -> None:
    """Samples that will never be trained on, consumed with the reason as status (at the current policy
    version). Idempotent."""
    if samples:
        with db.begin() as c:
            c.execute(insert(TrainSample).values([
                dict(run_id=uuid.UUID(run_id), version=version, **s.model_dump()) for s in samples
            ]).on_conflict_do_nothing())


def recorded_version(db: Engine, run_id: str) -> int:
    """The newest version whose step this trainer committed (0: none)."""
    with db.connect() as c:
        return c.execute(select(func.coalesce(func.max(TrainSample.version), 0)).where(
            TrainSample.run_id == uuid.UUID(run_id), TrainSample.status.in_(USED))).scalar_one()


def unfinishable_groups(db: Engine, run_id: str) -> set[tuple[str, int]]:
    """(task_id, batch_idx) of every group that can never complete: one with a slot the controller announced
    out of attempts (recorded `abandoned`) or a result with nothing to train on (`excluded`, never retried)."""
    with db.connect() as c:
        rows = c.execute(select(TrainSample.task_id, TrainSample.batch_idx).distinct().where(
            TrainSample.run_id == uuid.UUID(run_id), TrainSample.status.in_(DOOMING),
            TrainSample.batch_idx.is_not(None))).all()
    return {tuple(r) for r in rows}


def consumed_groups(db: Engine, run_id: str) -> list[ConsumedGroup]:
    """Every group this trainer recorded, as `trainer.progress` reports it: used, or the reason it was dropped
    (abandoned slots are the controller's own news and are not reported)."""
    with db.connect() as c:
        s = TrainSample
        rows = c.execute(select(s.task_id, s.batch_idx, func.bool_or(s.status.in_(USED)).label("used"),
                                func.min(s.status).filter(s.status != "abandoned").label("reason"))
                         .where(s.run_id == uuid.UUID(run_id), s.batch_idx.is_not(None))
                         .group_by(s.task_id, s.batch_idx)).all()
    return [ConsumedGroup(task_id=r.task_id, batch_idx=r.batch_idx, status="used" if r.used else r.reason)
            for r in rows if r.used or r.reason]


def is_published(db: Engine, run_id: str, version: int) -> bool:
    with db.connect() as c:
        return c.execute(select(Checkpoint.version).where(
            Checkpoint.run_id == uuid.UUID(run_id), Checkpoint.version == version)).first() is not None
