"""The ledger (`rollout_tasks`, one row per dispatched attempt) as the dispatch loop keeps it: read when a
controller takes a run, rows inserted before the XADD and marked published after it, leases renewed or expired
(lost), attempts failed (dead-lettered) or cancelled. Each write is conditional on the row still `dispatched`.

More: docs/architecture.md#the-ledger
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import Connection, func, select, text, update

from services.controller.plan import Slot
from shared.contracts.db.models import RolloutTaskRow


@dataclass
class LedgerRow:
    task_id: str
    sample_idx: int
    attempt: int
    status: str
    batch_idx: int
    epoch: int
    greedy: bool


def ledger_rows(conn: Connection, run_id: str) -> list[LedgerRow]:
    t = RolloutTaskRow
    return [LedgerRow(*r) for r in conn.execute(
        select(t.task_id, t.sample_idx, t.attempt, t.status, t.batch_idx, t.epoch, t.greedy)
        .where(t.run_id == run_id).order_by(t.attempt)).all()]


def ended_among(conn: Connection, run_id: str, keys: list[tuple[str, int, int]]
                ) -> list[tuple[str, int, int, str, str | None]]:
    """Which of these (task, sample, attempt) rows are no longer 'dispatched', their status and error."""
    if not keys:
        return []
    tasks, samples, attempts = (list(c) for c in zip(*keys, strict=True))
    return [tuple(r) for r in conn.execute(text(  # hand-tuned: the plan matters here, and Core would hide it
        # LATERAL: one primary-key probe per key. A plain join let the planner hash every ended row of the run,
        # a cost that grew with the run on every pass.
        """SELECT t.task_id, t.sample_idx, t.attempt, t.status, t.error
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[])) AS k(task_id, sample_idx, attempt)
           JOIN LATERAL (SELECT * FROM rollout_tasks r WHERE r.run_id = :r AND r.task_id = k.task_id
                         AND r.sample_idx = k.sample_idx AND r.attempt = k.attempt) t ON true
           WHERE t.status <> 'dispatched'"""
    ), {"r": run_id, "t": tasks, "s": samples, "a": attempts}).all()]


def insert_dispatched(conn: Connection, run_id: str, items: list[tuple[Slot, int]], version: int,
                      lease_s: float) -> set[tuple[str, int, int]]:
    """Ledger rows first (before XADD). Returns the keys actually inserted: a key another controller already
    inserted is not ours to publish."""
    if not items:
        return set()
    cols = list(zip(*[(s.task_id, s.sample_idx, a, s.batch_idx, s.epoch, s.greedy) for s, a in items], strict=True))
    rows = conn.execute(text(  # hand-tuned: one array per column (unnest) instead of a bind parameter per value
        """INSERT INTO rollout_tasks (run_id, task_id, sample_idx, attempt, status, batch_idx, epoch, greedy,
                                      dispatch_version, lease_expires_at)
           SELECT :r, t, s, a, 'dispatched', b, e, g, :v, now() + make_interval(secs => :lease)
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[]), CAST(:b AS int[]),
                       CAST(:e AS int[]), CAST(:g AS bool[])) AS x(t, s, a, b, e, g)
           ON CONFLICT DO NOTHING RETURNING task_id, sample_idx, attempt"""
    ), {"r": run_id, "v": version, "lease": lease_s, "t": list(cols[0]), "s": list(cols[1]), "a": list(cols[2]),
        "b": list(cols[3]), "e": list(cols[4]), "g": list(cols[5])}).all()
    return {tuple(r) for r in rows}


def mark_published(conn: Connection, run_id: str, keys: list[tuple[str, int, int]]) -> None:
    """These (task, sample, attempt) rows' tasks are on `rollout.tasks` (their XADD returned)."""
    if not keys:
        return
    tasks, samples, attempts = (list(c) for c in zip(*keys, strict=True))
    conn.execute(text(  # hand-tuned: one array per key column (unnest)
        """UPDATE rollout_tasks t SET published_at = now()
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[])) AS k(task_id, sample_idx, attempt)
           WHERE t.run_id = :r AND (t.task_id, t.sample_idx, t.attempt) = (k.task_id, k.sample_idx, k.attempt)"""
    ), {"r": run_id, "t": tasks, "s": samples, "a": attempts})


def take_unpublished(conn: Connection, run_id: str, lease_s: float) -> list[tuple[str, int, int, int]]:
    """Dispatched rows whose task was never known to be published (a controller died between the ledger commit
    and the XADD), their lease renewed for `lease_s` from now: (task, sample, attempt, dispatch_version)."""
    t = RolloutTaskRow
    return [tuple(r) for r in conn.execute(
        update(t).where(t.run_id == run_id, t.status == "dispatched", t.published_at.is_(None))
        .values(lease_expires_at=func.now() + timedelta(seconds=lease_s))
        .returning(t.task_id, t.sample_idx, t.attempt, t.dispatch_version)).all()]


def expire_leases(conn: Connection, run_id: str, held: list[tuple[str, int, int]] = (), renew_s: float = 0.0
                  ) -> list[tuple[str, int, int]]:
    """Mark dispatched rows past their lease as lost (their result never arrived, or Redis lost it), except
    those `held` (a live rollout worker runs them, or they wait in the stream re-stamped): their lease is
    renewed for `renew_s` once less than half of it is left."""
    t = RolloutTaskRow
    if held:
        tasks, samples, attempts = (list(c) for c in zip(*held, strict=True))
        conn.execute(text(  # hand-tuned: one array per key column (unnest)
            """UPDATE rollout_tasks t SET lease_expires_at = now() + make_interval(secs => :s)
               FROM unnest(CAST(:t AS text[]), CAST(:sa AS int[]), CAST(:a AS int[])) AS k(task_id, sample_idx, attempt)
               WHERE t.run_id = :r AND (t.task_id, t.sample_idx, t.attempt) = (k.task_id, k.sample_idx, k.attempt)
                 AND t.status = 'dispatched' AND t.lease_expires_at < now() + make_interval(secs => :s / 2)"""
        ), {"r": run_id, "t": tasks, "sa": samples, "a": attempts, "s": renew_s})
    return [tuple(r) for r in conn.execute(
        update(t).where(t.run_id == run_id, t.status == "dispatched", t.lease_expires_at < func.now())
        .values(status="lost", finished_at=func.now(), error="no result before the task lease expired")
        .returning(t.task_id, t.sample_idx, t.attempt)).all()]


def fail_dispatched(conn: Connection, run_id: str, key: tuple[str, int, int], error: str) -> bool:
    """A dead-lettered rollout task: its attempt has failed (retried as attempt+1 if attempts remain)."""
    t = RolloutTaskRow
    return conn.execute(
        update(t).where(t.run_id == run_id, t.task_id == key[0], t.sample_idx == key[1], t.attempt == key[2],
                        t.status == "dispatched")
        .values(status="failed", finished_at=func.now(), error=error)).rowcount == 1


def cancel_dispatched(conn: Connection, run_id: str, keys: list[tuple[str, int, int]], error: str
                      ) -> list[tuple[str, int, int]]:
    """Cancel these (task, sample, attempt) rows if still dispatched; returns those cancelled."""
    if not keys:
        return []
    tasks, samples, attempts = (list(c) for c in zip(*keys, strict=True))
    return [tuple(r) for r in conn.execute(text(  # hand-tuned: one array per key column (unnest)
        """UPDATE rollout_tasks t SET status = 'cancelled', finished_at = now(), error = :err
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[])) AS k(task_id, sample_idx, attempt)
           WHERE t.run_id = :r AND (t.task_id, t.sample_idx, t.attempt) = (k.task_id, k.sample_idx, k.attempt)
             AND t.status = 'dispatched'
           RETURNING t.task_id, t.sample_idx, t.attempt"""
    ), {"r": run_id, "t": tasks, "s": samples, "a": attempts, "err": error}).all()]


def cancel_in_flight(conn: Connection, run_id: str) -> int:
    t = RolloutTaskRow
    return conn.execute(update(t).where(t.run_id == run_id, t.status == "dispatched")
                        .values(status="cancelled", finished_at=func.now(), error="run stopped")).rowcount
