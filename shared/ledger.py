"""Questions about the dispatched-task ledger (`rollout_tasks`, one row per dispatched attempt).

    from shared.ledger import ledger_summary
    ledger_summary(session, run_id)   # sync Session or Connection
    await session.execute(ledger_summary_query(run_id)) -> summarize(rows)   # async callers

Row statuses: dispatched (in flight), completed, failed (infrastructure failure of that attempt), lost (no
result before its lease expired; re-dispatched as a new attempt), cancelled (stopped run). A (task, sample)
is "finished" when some attempt completed, or it finally failed (its last attempt failed or was lost with
no attempts left; the controller records those as `final_failure` run events).
"""

from __future__ import annotations

import uuid

from sqlalchemy import func, select

from shared.db.models import RolloutTaskRow

LEDGER_ROW_STATUSES = ("dispatched", "completed", "failed", "lost", "cancelled")


def ledger_summary_query(run_id: uuid.UUID | str):
    run = uuid.UUID(str(run_id))
    return (
        select(RolloutTaskRow.status, func.count())
        .where(RolloutTaskRow.run_id == run)
        .group_by(RolloutTaskRow.status)
    )


def summarize(rows) -> dict[str, int]:
    """{dispatched (attempts put on the stream), completed, failed, lost, cancelled, in_flight, finished}."""
    counts = {s: 0 for s in LEDGER_ROW_STATUSES}
    for status, n in rows:
        counts[status] = counts.get(status, 0) + n
    in_flight = counts.pop("dispatched")
    total = in_flight + sum(counts.values())
    return {"dispatched": total, "in_flight": in_flight, **counts, "finished": total - in_flight}


def ledger_summary(session, run_id: uuid.UUID | str) -> dict[str, int]:
    return summarize(session.execute(ledger_summary_query(run_id)).all())
