"""Who owns a run: one lease mechanism for every service, a row per (run, role) in Postgres (`run_leases`).

    held = acquire(conn, "trainer", worker_id, run_ids, ttl_s=15)   # take free/expired ones, renew ours
    release(conn, "trainer", worker_id)                               # at shutdown (or for some run_ids)

Guarantees (tested in tests/integration/test_leases.py):
- At most one owner per (run, role) at any instant of the database's clock: acquiring is one
  `INSERT ... ON CONFLICT DO UPDATE ... WHERE` statement, which Postgres serialises on the row, and it only
  overwrites a lease that is ours or has expired (`expires_at < now()`, the database's clock, so skewed host
  clocks do not matter).
- A holder that stops renewing loses the run after `ttl_s`; any other process then takes it over, and the old
  holder's next `acquire` no longer returns it (it must drop the run).
Roles in use: "controller" (drives the run's lifecycle and dispatch), "trainer" (trains it).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Connection, delete, text

from shared.db.models import RunLease

CONTROLLER = "controller"
TRAINER = "trainer"


def acquire(conn: Connection, role: str, owner: str, run_ids: Iterable[str], ttl_s: float) -> set[str]:
    """Take or renew `owner`'s lease on each of `run_ids` that is free, expired or already ours; returns the
    ids now held (the others belong to someone else)."""
    ids = sorted(set(run_ids))  # one lock order for every caller
    if not ids:
        return set()
    rows = conn.execute(text(  # kept as SQL: the one-statement guarantee above is easier to check in this form
        """INSERT INTO run_leases (run_id, role, owner, expires_at)
           SELECT id, :role, :owner, now() + make_interval(secs => :ttl) FROM unnest(CAST(:ids AS uuid[])) AS id
           ON CONFLICT (run_id, role) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at
             WHERE run_leases.owner = excluded.owner OR run_leases.expires_at < now()
           RETURNING run_id::text"""
    ), {"role": role, "owner": owner, "ttl": ttl_s, "ids": ids}).scalars().all()
    return set(rows)


def release(conn: Connection, role: str, owner: str, run_ids: Iterable[str] | None = None) -> None:
    """Give up `owner`'s leases (all of them, or those of `run_ids`) so another process takes over at once."""
    query = delete(RunLease).where(RunLease.role == role, RunLease.owner == owner)
    if run_ids is not None:
        query = query.where(RunLease.run_id.in_(list(run_ids)))
    conn.execute(query)


def free_or_ours(conn: Connection, role: str, owner: str, run_ids: Iterable[str]) -> list[str]:
    """Of `run_ids`, those whose lease is free, expired or ours, ours first (a hint for choosing what to
    acquire under a cap; `acquire` decides)."""
    ids = list(run_ids)
    if not ids:
        return []
    rows = conn.execute(text(  # kept as SQL: WITH ORDINALITY keeps the callers' order, which Core spells poorly
        """SELECT id::text FROM unnest(CAST(:ids AS uuid[])) WITH ORDINALITY AS r(id, n)
           LEFT JOIN run_leases l ON l.run_id = r.id AND l.role = :role
           WHERE l.owner IS NULL OR l.owner = :owner OR l.expires_at < now()
           ORDER BY (l.owner = :owner) IS TRUE DESC, n"""
    ), {"role": role, "owner": owner, "ids": ids}).scalars().all()
    return list(rows)
