"""Who owns a run: one lease mechanism, a table per service that leases runs, each written by that service
alone (`controller_leases`, `trainer_leases`).

    held = acquire(conn, TRAINER, worker_id, run_ids, ttl_s=15)   # take free/expired ones, renew ours
    release(conn, TRAINER, worker_id)                               # at shutdown (or for some run_ids)

Guarantees (tests/component/test_leases.py): at most one owner per run at any instant of the database's clock;
a holder that stops renewing loses the run after `ttl_s`, and its next `acquire` no longer returns it.

More: docs/reliability.md#leases
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Connection, text

CONTROLLER = "controller_leases"
TRAINER = "trainer_leases"
TABLES = (CONTROLLER, TRAINER)


def _table(table: str) -> str:
    if table not in TABLES:  # the name goes into SQL text: only these two
        raise ValueError(f"no lease table {table!r}; use leases.CONTROLLER or leases.TRAINER")
    return table


def acquire(conn: Connection, table: str, owner: str, run_ids: Iterable[str], ttl_s: float) -> set[str]:
    """Take or renew `owner`'s lease on each of `run_ids` that is free, expired or already ours; returns the
    ids now held (the others belong to someone else)."""
    ids = sorted(set(run_ids))  # one lock order for every caller
    if not ids:
        return set()
    rows = conn.execute(text(  # kept as SQL: the one-statement guarantee above is easier to check in this form
        f"""INSERT INTO {_table(table)} AS l (run_id, owner, expires_at)
           SELECT id, :owner, now() + make_interval(secs => :ttl) FROM unnest(CAST(:ids AS uuid[])) AS id
           ON CONFLICT (run_id) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at
             WHERE l.owner = excluded.owner OR l.expires_at < now()
           RETURNING run_id::text"""
    ), {"owner": owner, "ttl": ttl_s, "ids": ids}).scalars().all()
    return set(rows)


def release(conn: Connection, table: str, owner: str, run_ids: Iterable[str] | None = None) -> None:
    """Give up `owner`'s leases (all of them, or those of `run_ids`) so another process takes over at once."""
    if run_ids is None:
        conn.execute(text(f"DELETE FROM {_table(table)} WHERE owner = :owner"), {"owner": owner})
    else:
        conn.execute(text(f"DELETE FROM {_table(table)} WHERE owner = :owner AND run_id = ANY(CAST(:ids AS uuid[]))"),
                     {"owner": owner, "ids": list(run_ids)})


def free_or_ours(conn: Connection, table: str, owner: str, run_ids: Iterable[str]) -> list[str]:
    """Of `run_ids`, those whose lease is free, expired or ours, ours first (a hint for choosing what to
    acquire under a cap; `acquire` decides)."""
    ids = list(run_ids)
    if not ids:
        return []
    rows = conn.execute(text(  # kept as SQL: WITH ORDINALITY keeps the callers' order, which Core spells poorly
        f"""SELECT id::text FROM unnest(CAST(:ids AS uuid[])) WITH ORDINALITY AS r(id, n)
           LEFT JOIN {_table(table)} l ON l.run_id = r.id
           WHERE l.owner IS NULL OR l.owner = :owner OR l.expires_at < now()
           ORDER BY (l.owner = :owner) IS TRUE DESC, n"""
    ), {"owner": owner, "ids": ids}).scalars().all()
    return list(rows)
