"""Re-run units counted as such: `run_ledger.units_requeued` (units that scored after a lost or failed attempt),
and `run_error_reasons` lists only attempts of units that never scored, so a unit re-run under load and then
scored is not among "why units ended unscored".

Revision ID: 0008_requeued
Revises: 0007_leases
"""

from alembic import op

revision = "0008_requeued"
down_revision = "0007_leases"
branch_labels = None
depends_on = None

# 0006's unit states, plus `requeued` (a completed unit with a failed or lost attempt before it), which is not a
# state of its own: it counts within `completed`.
RUN_LEDGER = """
    WITH units AS (
        SELECT run_id, task_id, sample_idx, count(*) AS attempts,
               bool_or(status = 'completed') AS completed, bool_or(status = 'dispatched') AS in_flight,
               bool_or(status = 'error') AS errored,
               bool_or(status = 'cancelled') AS cancelled, count(*) FILTER (WHERE status IN ('failed', 'lost')) AS failures
        FROM rollout_tasks GROUP BY run_id, task_id, sample_idx
    ), unit_state AS (
        SELECT u.run_id, u.completed AND u.failures > 0 AS requeued, CASE
                   WHEN u.completed THEN 'completed' WHEN u.in_flight THEN 'in_flight'
                   WHEN u.errored THEN 'errored' WHEN u.cancelled THEN 'cancelled'
                   WHEN u.failures >= COALESCE((r.config ->> 'max_attempts')::int, 3)
                        OR r.status IN ('stopped', 'completed', 'failed') THEN 'failed'
                   ELSE 'retrying' END AS state
        FROM units u JOIN runs r ON r.id = u.run_id
    ), unit_counts AS (
        SELECT run_id, count(*) AS units_total,
               count(*) FILTER (WHERE state = 'completed') AS units_completed,
               count(*) FILTER (WHERE state = 'in_flight') AS units_in_flight,
               count(*) FILTER (WHERE state = 'retrying') AS units_retrying,
               count(*) FILTER (WHERE state = 'errored') AS units_errored,
               count(*) FILTER (WHERE state = 'failed') AS units_failed,
               count(*) FILTER (WHERE state = 'cancelled') AS units_cancelled,
               count(*) FILTER (WHERE requeued) AS units_requeued
        FROM unit_state GROUP BY run_id
    ), attempt_counts AS (
        SELECT run_id, count(*) AS attempts_total,
               count(*) FILTER (WHERE status = 'completed') AS attempts_completed,
               count(*) FILTER (WHERE status = 'dispatched') AS attempts_in_flight,
               count(*) FILTER (WHERE status = 'error') AS attempts_errored,
               count(*) FILTER (WHERE status = 'failed') AS attempts_failed,
               count(*) FILTER (WHERE status = 'lost') AS attempts_lost,
               count(*) FILTER (WHERE status = 'cancelled') AS attempts_cancelled
        FROM rollout_tasks GROUP BY run_id
    )
    SELECT r.id AS run_id, r.name AS run_name, r.status AS run_status,
           COALESCE(u.units_total, 0) AS units_total, COALESCE(u.units_completed, 0) AS units_completed,
           COALESCE(u.units_in_flight, 0) AS units_in_flight, COALESCE(u.units_retrying, 0) AS units_retrying,
           COALESCE(u.units_failed, 0) AS units_failed, COALESCE(u.units_cancelled, 0) AS units_cancelled,
           COALESCE(a.attempts_total, 0) AS attempts_total, COALESCE(a.attempts_completed, 0) AS attempts_completed,
           COALESCE(a.attempts_in_flight, 0) AS attempts_in_flight, COALESCE(a.attempts_failed, 0) AS attempts_failed,
           COALESCE(a.attempts_lost, 0) AS attempts_lost, COALESCE(a.attempts_cancelled, 0) AS attempts_cancelled,
           COALESCE(u.units_errored, 0) AS units_errored, COALESCE(a.attempts_errored, 0) AS attempts_errored,
           r.stall_reason, r.stalled_since, COALESCE(u.units_requeued, 0) AS units_requeued
    FROM runs r LEFT JOIN unit_counts u ON u.run_id = r.id LEFT JOIN attempt_counts a ON a.run_id = r.id
"""
ERROR_REASONS = """
    SELECT run_id, status AS outcome,
           CASE WHEN status = 'error' THEN split_part(error, E'\\n', 1)
                ELSE (regexp_match(rtrim(COALESCE(error, status), E'\\n\\t '), '[^\\n]*$'))[1] END AS reason,
           count(*) AS attempts, count(DISTINCT (task_id, sample_idx)) AS units,
           min(finished_at) AS first_at, max(finished_at) AS last_at
    FROM rollout_tasks t WHERE status IN ('error', 'failed', 'lost')
      AND NOT EXISTS (SELECT 1 FROM rollout_tasks c WHERE c.run_id = t.run_id AND c.task_id = t.task_id
                      AND c.sample_idx = t.sample_idx AND c.status = 'completed')
    GROUP BY 1, 2, 3
"""
OLD_RUN_LEDGER = """
    WITH units AS (
        SELECT run_id, task_id, sample_idx, count(*) AS attempts,
               bool_or(status = 'completed') AS completed, bool_or(status = 'dispatched') AS in_flight,
               bool_or(status = 'error') AS errored,
               bool_or(status = 'cancelled') AS cancelled, count(*) FILTER (WHERE status IN ('failed', 'lost')) AS failures
        FROM rollout_tasks GROUP BY run_id, task_id, sample_idx
    ), unit_state AS (
        SELECT u.run_id, CASE
                   WHEN u.completed THEN 'completed' WHEN u.in_flight THEN 'in_flight'
                   WHEN u.errored THEN 'errored' WHEN u.cancelled THEN 'cancelled'
                   WHEN u.failures >= COALESCE((r.config ->> 'max_attempts')::int, 3)
                        OR r.status IN ('stopped', 'completed', 'failed') THEN 'failed'
                   ELSE 'retrying' END AS state
        FROM units u JOIN runs r ON r.id = u.run_id
    ), unit_counts AS (
        SELECT run_id, count(*) AS units_total,
               count(*) FILTER (WHERE state = 'completed') AS units_completed,
               count(*) FILTER (WHERE state = 'in_flight') AS units_in_flight,
               count(*) FILTER (WHERE state = 'retrying') AS units_retrying,
               count(*) FILTER (WHERE state = 'errored') AS units_errored,
               count(*) FILTER (WHERE state = 'failed') AS units_failed,
               count(*) FILTER (WHERE state = 'cancelled') AS units_cancelled
        FROM unit_state GROUP BY run_id
    ), attempt_counts AS (
        SELECT run_id, count(*) AS attempts_total,
               count(*) FILTER (WHERE status = 'completed') AS attempts_completed,
               count(*) FILTER (WHERE status = 'dispatched') AS attempts_in_flight,
               count(*) FILTER (WHERE status = 'error') AS attempts_errored,
               count(*) FILTER (WHERE status = 'failed') AS attempts_failed,
               count(*) FILTER (WHERE status = 'lost') AS attempts_lost,
               count(*) FILTER (WHERE status = 'cancelled') AS attempts_cancelled
        FROM rollout_tasks GROUP BY run_id
    )
    SELECT r.id AS run_id, r.name AS run_name, r.status AS run_status,
           COALESCE(u.units_total, 0) AS units_total, COALESCE(u.units_completed, 0) AS units_completed,
           COALESCE(u.units_in_flight, 0) AS units_in_flight, COALESCE(u.units_retrying, 0) AS units_retrying,
           COALESCE(u.units_failed, 0) AS units_failed, COALESCE(u.units_cancelled, 0) AS units_cancelled,
           COALESCE(a.attempts_total, 0) AS attempts_total, COALESCE(a.attempts_completed, 0) AS attempts_completed,
           COALESCE(a.attempts_in_flight, 0) AS attempts_in_flight, COALESCE(a.attempts_failed, 0) AS attempts_failed,
           COALESCE(a.attempts_lost, 0) AS attempts_lost, COALESCE(a.attempts_cancelled, 0) AS attempts_cancelled,
           COALESCE(u.units_errored, 0) AS units_errored, COALESCE(a.attempts_errored, 0) AS attempts_errored,
           r.stall_reason, r.stalled_since
    FROM runs r LEFT JOIN unit_counts u ON u.run_id = r.id LEFT JOIN attempt_counts a ON a.run_id = r.id
"""
OLD_ERROR_REASONS = """
    SELECT run_id, status AS outcome,
           CASE WHEN status = 'error' THEN split_part(error, E'\\n', 1)
                ELSE (regexp_match(rtrim(COALESCE(error, status), E'\\n\\t '), '[^\\n]*$'))[1] END AS reason,
           count(*) AS attempts, count(DISTINCT (task_id, sample_idx)) AS units,
           min(finished_at) AS first_at, max(finished_at) AS last_at
    FROM rollout_tasks WHERE status IN ('error', 'failed', 'lost')
    GROUP BY 1, 2, 3
"""
READER = "flywheel_reader"


def _replace(views: dict[str, str]) -> None:
    for name, body in views.items():  # columns change, so CREATE OR REPLACE cannot be used
        op.execute(f"DROP VIEW IF EXISTS {name}")
        op.execute(f"CREATE VIEW {name} AS {body}")
        op.execute(f"GRANT SELECT ON {name} TO {READER}")


def upgrade() -> None:
    _replace({"run_ledger": RUN_LEDGER, "run_error_reasons": ERROR_REASONS})


def downgrade() -> None:
    _replace({"run_ledger": OLD_RUN_LEDGER, "run_error_reasons": OLD_ERROR_REASONS})
