"""The groups (task, batch) as the trainer sees them: what it reported on `trainer.progress` (its policy
version, the groups it consumed or dropped, its errors; `consumed_groups`), and what it must hear again after
Redis lost its data (stored groups it never consumed, slots whose groups can never complete).

More: docs/architecture.md#the-ledger
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine, Integer, and_, cast, exists, func, select, text, update

from shared.contracts.db.models import ConsumedGroupRow, EpisodeRow, RolloutTaskRow, Run, RunEvent
from shared.contracts.messages import TrainerProgress


def dropped_groups(conn: Connection, run_id: str, final_failed: list[tuple[str, int]]) -> int:
    """Groups of a train run consumed without a step: those the trainer reported dropped (`consumed_groups`,
    from `trainer.progress`) and those with a finally failed slot (never complete, perhaps never seen by the
    trainer). `final_failed`: (task_id, batch_idx) of the finally failed slots. A group is (task, batch)."""
    tasks, batches = [k[0] for k in final_failed], [k[1] for k in final_failed]
    return conn.execute(text(  # kept as SQL: a UNION with an unnest of arrays reads plainer than its Core form
        """SELECT count(*) FROM (
               SELECT task_id, batch_idx FROM consumed_groups WHERE run_id = :r AND status <> 'used'
               UNION
               SELECT t, b FROM unnest(CAST(:t AS text[]), CAST(:b AS int[])) AS f(t, b)) AS g"""
    ), {"r": run_id, "t": tasks, "b": batches}).scalar_one()


def record_progress(db: Engine, msgs: list[TrainerProgress]) -> None:
    """Apply `trainer.progress`: the run's policy version (never backwards), the groups it consumed (the
    first report of a group wins), and a trainer's error as one `trainer_error` event per distinct error.
    Idempotent: the trainer re-sends freely. Runs that no longer exist are skipped."""
    with db.begin() as conn:
        for m in msgs:
            if m.error is not None:
                conn.execute(text(
                    """INSERT INTO run_events (run_id, kind, message, data)
                       SELECT CAST(:r AS uuid), 'trainer_error', :m, '{}'
                       WHERE EXISTS (SELECT 1 FROM runs WHERE id = CAST(:r AS uuid))
                         AND NOT EXISTS (SELECT 1 FROM run_events WHERE run_id = CAST(:r AS uuid)
                                         AND kind = 'trainer_error' AND message = :m)"""
                ), {"r": m.run_id, "m": m.error})
            conn.execute(update(Run).where(Run.id == m.run_id)
                         .values(policy_version=func.greatest(Run.policy_version, m.version)))
            if m.groups:
                conn.execute(text(  # hand-tuned: one array per column (unnest), skipped whole when the run is gone
                    """INSERT INTO consumed_groups (run_id, task_id, batch_idx, status, version)
                       SELECT CAST(:r AS uuid), t, b, s, :v FROM unnest(CAST(:t AS text[]), CAST(:b AS int[]),
                                                                      CAST(:s AS text[])) AS g(t, b, s)
                       WHERE EXISTS (SELECT 1 FROM runs WHERE id = CAST(:r AS uuid))
                       ON CONFLICT DO NOTHING"""
                ), {"r": m.run_id, "v": m.version, "t": [g.task_id for g in m.groups],
                    "b": [g.batch_idx for g in m.groups], "s": [g.status for g in m.groups]})


def unconsumed_groups(conn: Connection, run_id: str) -> set[tuple[str, int]]:
    """(task_id, batch_idx) of the groups with stored completed results that the trainer has not reported
    consuming."""
    e, g = EpisodeRow, ConsumedGroupRow
    consumed = exists().where(g.run_id == e.run_id, g.task_id == e.task_id, g.batch_idx == e.batch_idx)
    query = select(e.task_id, e.batch_idx).distinct().where(e.run_id == run_id, e.status == "completed", ~consumed)
    return {tuple(r) for r in conn.execute(query).all()}


def final_failures(conn: Connection, run_id: str) -> list[tuple[str, int, int, int, bool]]:
    """(task_id, sample_idx, attempt, batch_idx, greedy) of every slot recorded out of attempts or errored (the
    user's code failed): slots whose groups can never complete."""
    t, e = RolloutTaskRow, RunEvent
    slot = and_(t.run_id == e.run_id, t.task_id == e.data["task_id"].astext,
                t.sample_idx == cast(e.data["sample_idx"].astext, Integer),
                t.attempt == cast(e.data["attempt"].astext, Integer))
    recorded = select(t.task_id, t.sample_idx, t.attempt, t.batch_idx, t.greedy).select_from(e).join(t, slot) \
        .where(e.run_id == run_id, e.kind == "final_failure")
    errored = select(t.task_id, t.sample_idx, t.attempt, t.batch_idx, t.greedy) \
        .where(t.run_id == run_id, t.status == "error")
    return [tuple(r) for r in conn.execute(recorded.union_all(errored)).all()]
