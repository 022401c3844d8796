"""The controller's reads and writes of `runs`, `dataset_rows` and the ledger (`rollout_tasks`). Sync
SQLAlchemy on a Connection; callers run these in a thread. Every write is conditional (compare-and-set on
the status it expects) so that a controller that lost its lease, or a concurrent API change, is never
overwritten."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy import Connection, text

from services.controller.plan import Slot

ACTIVE_STATUSES = ("pending", "running", "paused", "stopping")


@dataclass
class RunRow:
    id: str
    status: str
    config: dict
    policy_version: int


@dataclass
class LedgerRow:
    task_id: str
    sample_idx: int
    attempt: int
    status: str
    batch_idx: int
    epoch: int
    greedy: bool


def lease_runs(conn: Connection, owner: str, lease_s: float, limit: int) -> list[RunRow]:
    """Take or renew the lease of every active run that is free, expired, or already ours (up to `limit`)."""
    rows = conn.execute(text(
        """UPDATE runs SET lease_owner = :owner, lease_expires_at = now() + make_interval(secs => :lease)
           WHERE id IN (SELECT id FROM runs WHERE status = ANY(:active)
                          AND (lease_owner IS NULL OR lease_owner = :owner OR lease_expires_at < now())
                        ORDER BY created_at LIMIT :limit FOR UPDATE SKIP LOCKED)
           RETURNING id::text, status, config, policy_version"""
    ), {"owner": owner, "lease": lease_s, "active": list(ACTIVE_STATUSES), "limit": limit}).all()
    return [RunRow(*r) for r in rows]


def release_runs(conn: Connection, owner: str) -> None:
    conn.execute(text("UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL WHERE lease_owner = :o"),
                 {"o": owner})


def set_status(conn: Connection, run_id: str, old: str, new: str, *, error: str | None = None) -> bool:
    """Compare-and-set runs.status; stamps started_at / finished_at. False when someone changed it first."""
    stamps = {"running": ", started_at = coalesce(started_at, now())",
              "stopped": ", finished_at = now()", "completed": ", finished_at = now()", "failed": ", finished_at = now()"}
    done = conn.execute(text(
        f"UPDATE runs SET status = :new, error = coalesce(:error, error){stamps.get(new, '')} "
        "WHERE id = :id AND status = :old"
    ), {"id": run_id, "old": old, "new": new, "error": error}).rowcount == 1
    if done:
        add_event(conn, run_id, "status_changed", f"{old} -> {new}" + (f": {error}" if error else ""),
                  {"from": old, "to": new})
    return done


def add_event(conn: Connection, run_id: str, kind: str, message: str, data: dict[str, Any],
              *, once: bool = False) -> None:
    """Append a run event; `once` skips it if an event of this kind with the same data exists (idempotent)."""
    guard = " WHERE NOT EXISTS (SELECT 1 FROM run_events WHERE run_id = CAST(:r AS uuid) AND kind = CAST(:k AS varchar) AND data @> CAST(:d AS jsonb))" if once else ""
    conn.execute(text(
        "INSERT INTO run_events (run_id, kind, message, data) "
        f"SELECT CAST(:r AS uuid), CAST(:k AS varchar), CAST(:m AS text), CAST(:d AS jsonb){guard}"
    ), {"r": run_id, "k": kind, "m": message, "d": _jsonb(data)})


def load_tasks(conn: Connection, name: str, split: str, limit: int | None) -> list[tuple[str, dict, str]]:
    """(task_id, data, data_source) of a dataset split in row order; raises ValueError when it is missing."""
    found = conn.execute(text("SELECT id FROM datasets WHERE name = :n AND split = :s"),
                         {"n": name, "s": split}).scalar()
    if found is None:
        raise ValueError(f"dataset {name!r} split {split!r} is not registered; register it (POST /v1/datasets) "
                         "or fix `dataset` / `dataset_split` in the run config")
    rows = conn.execute(text(
        "SELECT task_id, data, data_source FROM dataset_rows WHERE dataset_id = :d ORDER BY idx LIMIT :lim"
    ), {"d": found, "lim": limit}).all()
    ids = [r[0] for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"dataset {name!r} split {split!r} has duplicate task ids; give each row a unique "
                         "'task_id' or 'id' field")
    return [tuple(r) for r in rows]


def ledger_rows(conn: Connection, run_id: str) -> list[LedgerRow]:
    return [LedgerRow(*r) for r in conn.execute(text(
        "SELECT task_id, sample_idx, attempt, status, batch_idx, epoch, greedy FROM rollout_tasks "
        "WHERE run_id = :r ORDER BY attempt"
    ), {"r": run_id}).all()]


def ended_among(conn: Connection, run_id: str, keys: list[tuple[str, int, int]]) -> list[tuple[str, int, int, str]]:
    """Which of these (task, sample, attempt) rows are no longer 'dispatched', and their status."""
    if not keys:
        return []
    tasks, samples, attempts = (list(c) for c in zip(*keys, strict=True))
    return [tuple(r) for r in conn.execute(text(
        # LATERAL: one primary-key probe per key. A plain join let the planner hash every ended row of the run,
        # a cost that grew with the run on every pass.
        """SELECT t.task_id, t.sample_idx, t.attempt, t.status
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
    rows = conn.execute(text(
        """INSERT INTO rollout_tasks (run_id, task_id, sample_idx, attempt, status, batch_idx, epoch, greedy,
                                      dispatch_version, lease_expires_at)
           SELECT :r, t, s, a, 'dispatched', b, e, g, :v, now() + make_interval(secs => :lease)
           FROM unnest(CAST(:t AS text[]), CAST(:s AS int[]), CAST(:a AS int[]), CAST(:b AS int[]),
                       CAST(:e AS int[]), CAST(:g AS bool[])) AS x(t, s, a, b, e, g)
           ON CONFLICT DO NOTHING RETURNING task_id, sample_idx, attempt"""
    ), {"r": run_id, "v": version, "lease": lease_s, "t": list(cols[0]), "s": list(cols[1]), "a": list(cols[2]),
        "b": list(cols[3]), "e": list(cols[4]), "g": list(cols[5])}).all()
    return {tuple(r) for r in rows}


def dropped_groups(conn: Connection, run_id: str, slots_per_task: int, final_failed: set[tuple[str, int]]) -> int:
    """Groups of a train run consumed without a step: those the trainer dropped (train_samples rows that are
    neither used nor a baseline) and those with a finally failed slot (never complete, perhaps never seen by the
    trainer). A group is (task, epoch), and sample_idx = epoch * slots_per_task + s (see plan.py)."""
    tasks, samples = ([k[0] for k in final_failed], [k[1] for k in final_failed])
    return conn.execute(text(
        """SELECT count(*) FROM (
               SELECT task_id, sample_idx / :spt FROM train_samples
               WHERE run_id = :r AND status NOT IN ('used', 'baseline')
               UNION
               SELECT t, s / :spt FROM unnest(CAST(:t AS text[]), CAST(:s AS int[])) AS f(t, s)) AS g"""
    ), {"r": run_id, "spt": slots_per_task, "t": tasks, "s": samples}).scalar_one()


def expire_leases(conn: Connection, run_id: str) -> list[tuple[str, int, int]]:
    """Mark dispatched rows past their lease as lost (their result never arrived, or Redis lost it)."""
    return [tuple(r) for r in conn.execute(text(
        """UPDATE rollout_tasks SET status = 'lost', finished_at = now(),
               error = 'no result before the task lease expired'
           WHERE run_id = :r AND status = 'dispatched' AND lease_expires_at < now()
           RETURNING task_id, sample_idx, attempt"""
    ), {"r": run_id}).all()]


def fail_dispatched(conn: Connection, run_id: str, key: tuple[str, int, int], error: str) -> bool:
    """A dead-lettered rollout task: its attempt has failed (retried as attempt+1 if attempts remain)."""
    return conn.execute(text(
        """UPDATE rollout_tasks SET status = 'failed', finished_at = now(), error = :err
           WHERE run_id = :r AND task_id = :t AND sample_idx = :s AND attempt = :a AND status = 'dispatched'"""
    ), {"r": run_id, "t": key[0], "s": key[1], "a": key[2], "err": error}).rowcount == 1


def cancel_in_flight(conn: Connection, run_id: str) -> int:
    return conn.execute(text(
        """UPDATE rollout_tasks SET status = 'cancelled', finished_at = now(), error = 'run stopped'
           WHERE run_id = :r AND status = 'dispatched'"""
    ), {"r": run_id}).rowcount


def eval_samples(conn: Connection, run_id: str, name: str, split: str) -> list[tuple[str, str, bool]]:
    """(task_id, data_source, is_correct) of every stored completed sample of an eval run."""
    return [tuple(r) for r in conn.execute(text(
        """SELECT e.task_id, coalesce(r.data_source, ''), e.is_correct FROM episodes e
           LEFT JOIN (SELECT dr.task_id, dr.data_source FROM dataset_rows dr JOIN datasets d ON d.id = dr.dataset_id
                      WHERE d.name = :n AND d.split = :s) r USING (task_id)
           WHERE e.run_id = :r AND e.status = 'completed'"""
    ), {"r": run_id, "n": name, "s": split}).all()]


def write_summary(conn: Connection, run_id: str, summary: dict, metrics: dict[str, float]) -> None:
    conn.execute(text("UPDATE runs SET summary = summary || :s WHERE id = :r"), {"r": run_id, "s": _jsonb(summary)})
    conn.execute(text("DELETE FROM metrics WHERE run_id = :r AND step = 0 AND name LIKE 'eval/%'"), {"r": run_id})
    if metrics:
        conn.execute(text("INSERT INTO metrics (run_id, name, step, value) VALUES (:r, :n, 0, :v)"),
                     [{"r": run_id, "n": n, "v": v} for n, v in metrics.items()])


def _jsonb(obj: Any) -> Jsonb:
    return Jsonb(obj)
