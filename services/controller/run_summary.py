"""How a run's units ended, read off the ledger: the summary a finished run keeps (`runs.summary`: counts per
ledger status, units re-run, the most common reasons units failed) and the reason a run none of whose units
scored fails with (lifecycle.py).

More: docs/architecture.md#the-ledger
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, exists, func, literal, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import aliased

from services.controller.run_driver import outcome_reason
from shared.contracts.db.models import RolloutTaskRow, Run

LEDGER_ROW_STATUSES = ("dispatched", "completed", "error", "failed", "lost", "cancelled")


def top_reasons(conn: Connection, run_id: str, limit: int = 5) -> list[dict[str, Any]]:
    """Why units that never scored ended so, most common first: [{"reason", "status" (error | failed | lost),
    "count" (attempts)}]. A user-code error's reason is its ledger row's error ("<where>: <exception>"); an infrastructure
    failure's is its traceback's last line, numbers and addresses folded together."""
    t, c = RolloutTaskRow, aliased(RolloutTaskRow)
    scored = exists().where(c.run_id == t.run_id, c.task_id == t.task_id, c.sample_idx == t.sample_idx,
                            c.status == "completed")  # a unit re-run and then scored did not end unscored
    rows = conn.execute(select(t.status, t.error, func.count()).where(
        t.run_id == run_id, t.status.in_(("error", "failed", "lost")), ~scored).group_by(t.status, t.error)
        .order_by(func.count().desc()).limit(500)).all()
    counts: dict[tuple[str, str], int] = {}
    for status, error, n in rows:
        key = (status, outcome_reason(status, error))
        counts[key] = counts.get(key, 0) + n
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [{"reason": reason, "status": status, "count": n} for (status, reason), n in top]


def write_summary(conn: Connection, run_id: str, summary: dict) -> None:
    conn.execute(update(Run).where(Run.id == run_id)
                 .values(summary=Run.summary.op("||")(literal(summary, JSONB))))


def requeued_units(conn: Connection, run_id: str) -> int:
    """Units that scored after a lost or failed attempt was re-run."""
    t, c = RolloutTaskRow, aliased(RolloutTaskRow)
    return conn.execute(select(func.count(func.distinct(func.row(t.task_id, t.sample_idx)))).where(
        t.run_id == run_id, t.status.in_(("failed", "lost")),
        exists().where(c.run_id == t.run_id, c.task_id == t.task_id, c.sample_idx == t.sample_idx,
                       c.status == "completed"))).scalar_one()


def ledger_summary(conn: Connection, run_id: str) -> dict[str, int]:
    """{dispatched (attempts put on the stream), completed, error, failed, lost, cancelled, in_flight,
    finished}."""
    t = RolloutTaskRow
    counts = dict.fromkeys(LEDGER_ROW_STATUSES, 0)
    for status, n in conn.execute(select(t.status, func.count()).where(t.run_id == run_id).group_by(t.status)):
        counts[status] = counts.get(status, 0) + n
    in_flight = counts.pop("dispatched")
    total = in_flight + sum(counts.values())
    return {"dispatched": total, "in_flight": in_flight, **counts, "finished": total - in_flight}
