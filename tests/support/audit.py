"""Exactly-once accounting of a run, straight from Postgres: what was dispatched, stored, finally failed,
lost, or doubled. The chaos suite, the load benchmark and the end-to-end tests all judge a run with this.

Counted per (task, sample) slot, since attempts are how the system recovers:
- dispatched: slots with at least one ledger row (an attempt put on `rollout.tasks`);
- stored: slots with a stored completed (scored) episode;
- errored: slots without one whose user code failed (a stored `error` episode: final, not retried);
- failed_recorded: slots without a stored episode whose failure was recorded (`final_failure` run event);
- lost: dispatched - stored - errored - failed_recorded (work that vanished: must be 0);
- duplicates: extra completed episodes for one slot (two attempts both stored, e.g. a zombie worker's write),
  plus slots both stored and recorded as failed, plus episodes sharing a natural key (the unique constraint
  should make this impossible: it is counted to prove it).
"""

from __future__ import annotations

import uuid

from sqlalchemy import text

# Kept as SQL: one reporting query, documented above, that reads the same when pasted into psql.
ACCOUNTING_SQL = text("""
WITH dispatched AS (
    SELECT DISTINCT task_id, sample_idx FROM rollout_tasks WHERE run_id = :run
), stored AS (
    SELECT task_id, sample_idx, count(*) AS n FROM episodes
    WHERE run_id = :run AND status = 'completed' GROUP BY task_id, sample_idx
), failed AS (
    SELECT DISTINCT data->>'task_id' AS task_id, (data->>'sample_idx')::int AS sample_idx
    FROM run_events WHERE run_id = :run AND kind = 'final_failure'
), errored AS (
    SELECT DISTINCT task_id, sample_idx FROM episodes e WHERE run_id = :run AND status = 'error'
    AND NOT EXISTS (SELECT 1 FROM stored s WHERE s.task_id = e.task_id AND s.sample_idx = e.sample_idx)
), natural_key_dupes AS (
    SELECT count(*) - count(DISTINCT (task_id, sample_idx, attempt)) AS n FROM episodes WHERE run_id = :run
)
SELECT
    (SELECT count(*) FROM dispatched) AS dispatched,
    (SELECT count(*) FROM stored) AS stored,
    (SELECT count(*) FROM errored) AS errored,
    (SELECT count(*) FROM failed f WHERE NOT EXISTS (
        SELECT 1 FROM stored s WHERE s.task_id = f.task_id AND s.sample_idx = f.sample_idx) AND NOT EXISTS (
        SELECT 1 FROM errored x WHERE x.task_id = f.task_id AND x.sample_idx = f.sample_idx)) AS failed_recorded,
    (SELECT coalesce(sum(n - 1), 0) FROM stored) AS extra_stored,
    (SELECT count(*) FROM failed f JOIN stored s USING (task_id, sample_idx)) AS stored_and_failed,
    (SELECT n FROM natural_key_dupes) AS natural_key_dupes,
    (SELECT count(*) FROM run_events WHERE run_id = :run AND kind = 'late_result') AS late_results
""")


def run_accounting(conn, run_id: uuid.UUID | str) -> dict[str, int]:
    """`conn`: a SQLAlchemy Connection or Session. Returns the counts described in the module docstring."""
    row = conn.execute(ACCOUNTING_SQL, {"run": uuid.UUID(str(run_id))}).mappings().one()
    counts = {k: int(v) for k, v in row.items()}
    counts["lost"] = counts["dispatched"] - counts["stored"] - counts["errored"] - counts["failed_recorded"]
    counts["duplicates"] = counts.pop("extra_stored") + counts.pop("stored_and_failed") + counts.pop(
        "natural_key_dupes")
    return counts
