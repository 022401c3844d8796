"""Postgres side of the trainer: which runs to train, the trainer lease, and each step's durable record."""

from __future__ import annotations

import uuid

from redis.asyncio import Redis
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.dialects.postgresql import insert

from services.trainer.state import SampleRecord, StepRecord
from shared.db.models import Checkpoint, Metric, RolloutTaskRow, Run, RunEvent, TrainSample
from shared.streams import trainer_lease_key

ACTIVE = ("running", "paused")  # a paused run keeps training on what already arrived
LATE_LEDGER = ("lost", "cancelled", "failed")  # attempts whose results must not be trained on

_RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end return 0"""


class RunRow:
    def __init__(self, row):
        self.id, self.kind, self.status = str(row.id), row.kind, row.status
        self.config, self.policy_version = row.config, row.policy_version

    @property
    def trainable(self) -> bool:
        return self.kind == "train" and self.status in ACTIVE


def load_run(db: Engine, run_id: str) -> RunRow | None:
    with db.connect() as c:
        row = c.execute(select(Run).where(Run.id == uuid.UUID(run_id))).first()
    return RunRow(row) if row else None


def active_runs(db: Engine) -> list[RunRow]:
    with db.connect() as c:
        rows = c.execute(select(Run).where(Run.kind == "train", Run.status.in_(ACTIVE))).all()
    return [RunRow(r) for r in rows]


async def hold_lease(redis: Redis, run_id: str, owner: str, ttl_s: float) -> bool:
    """Take or renew this process's lease on a run; False while another trainer holds it."""
    return bool(await redis.eval(_RENEW, 1, trainer_lease_key(run_id), owner, int(ttl_s * 1000)))


async def release_lease(redis: Redis, run_id: str, owner: str) -> None:
    await redis.eval("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end "
                     "return 0", 1, trainer_lease_key(run_id), owner)


def screen(db: Engine, run_id: str, keys: list[tuple[str, int, int]]) -> tuple[set, set]:
    """(samples already consumed by a step, attempts the ledger says must not be trained on) among `keys`
    ((task_id, sample_idx, attempt) triples)."""
    run = uuid.UUID(run_id)
    tasks = list({k[0] for k in keys})
    with db.connect() as c:
        used = c.execute(select(TrainSample.task_id, TrainSample.sample_idx).where(
            TrainSample.run_id == run, TrainSample.task_id.in_(tasks))).all()
        late = c.execute(select(RolloutTaskRow.task_id, RolloutTaskRow.sample_idx, RolloutTaskRow.attempt).where(
            RolloutTaskRow.run_id == run, RolloutTaskRow.task_id.in_(tasks),
            RolloutTaskRow.status.in_(LATE_LEDGER))).all()
    return {tuple(r) for r in used}, {tuple(r) for r in late}


def commit_step(db: Engine, record: StepRecord) -> None:
    """One transaction: which samples the step consumed, runs.policy_version, the step's metrics.
    Idempotent, so recovery can replay it from the checkpoint's STEP.json."""
    run = uuid.UUID(record.run_id)
    with db.begin() as c:
        if record.samples:
            c.execute(insert(TrainSample).values([
                dict(run_id=run, version=record.version, **s.model_dump()) for s in record.samples
            ]).on_conflict_do_nothing())
        c.execute(update(Run).where(Run.id == run).values(
            policy_version=func.greatest(Run.policy_version, record.version)))
        c.execute(text("DELETE FROM metrics WHERE run_id = :r AND step = :s"), {"r": run, "s": record.version})
        if record.metrics:
            c.execute(insert(Metric).values([
                dict(run_id=run, name=k, step=record.version, value=float(v)) for k, v in record.metrics.items()
            ]))


def record_dropped(db: Engine, run_id: str, version: int, samples: list[SampleRecord]) -> None:
    """Samples of groups that will never be trained on, consumed with their drop reason as status (at the
    current policy version). Idempotent."""
    if samples:
        with db.begin() as c:
            c.execute(insert(TrainSample).values([
                dict(run_id=uuid.UUID(run_id), version=version, **s.model_dump()) for s in samples
            ]).on_conflict_do_nothing())


def unfinishable_groups(db: Engine, run_id: str) -> set[tuple[str, int]]:
    """(task_id, batch_idx) of every group that can never complete: one with a slot the controller gave up on
    (a `final_failure` event) or a stored result the trainer recorded as having nothing to train on
    (`excluded`, never retried)."""
    with db.connect() as c:
        rows = c.execute(text(
            """SELECT t.task_id, t.batch_idx FROM run_events e
               JOIN rollout_tasks t ON t.run_id = e.run_id AND t.task_id = e.data->>'task_id'
                                   AND t.sample_idx = CAST(e.data->>'sample_idx' AS int)
               WHERE e.run_id = :r AND e.kind = 'final_failure'
               UNION
               SELECT t.task_id, t.batch_idx FROM train_samples s
               JOIN rollout_tasks t USING (run_id, task_id, sample_idx)
               WHERE s.run_id = :r AND s.status = 'excluded'"""
        ), {"r": uuid.UUID(run_id)}).all()
    return {tuple(r) for r in rows}


def is_published(db: Engine, run_id: str, version: int) -> bool:
    with db.connect() as c:
        return c.execute(select(Checkpoint.version).where(
            Checkpoint.run_id == uuid.UUID(run_id), Checkpoint.version == version)).first() is not None


def record_event(db: Engine, run_id: str, kind: str, message: str) -> None:
    with db.begin() as c:
        c.execute(insert(RunEvent).values(run_id=uuid.UUID(run_id), kind=kind, message=message, data={}))
