"""Run outcomes and stalls: a unit whose user code failed is `error` (its own outcome, apart from scored and
failed units) in `run_ledger` and `failures_by_termination_reason`; `run_error_reasons` sums up why attempts
ended unscored; `runs` gains `stall_reason` / `stalled_since` (why a running run makes no progress, detected by
the controller) and `warning` (progress that teaches nothing, e.g. groups without learning signal).

Revision ID: 0006_outcomes
Revises: 0003_api
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_outcomes"
down_revision = "0003_api"
branch_labels = None
depends_on = None

# A unit is one (task, sample) of a run. In this order of precedence: completed (some attempt produced a scored
# result), in_flight, errored (an attempt ended `error`: the user's env, reward function, agent, workflow or agent
# program failed; final), cancelled, failed (out of attempts, or the run ended without finishing it), retrying.
RUN_LEDGER = """
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

# Every stored episode by why it ended: scored ones (`completed`), user-code errors (`error`: termination_reason
# error or env_timeout) and infrastructure failures (`failed`, infra_error, no trajectory) counted apart.
FAILURES = """
    SELECT e.run_id, e.termination_reason, count(*) AS num_episodes,
           count(*) FILTER (WHERE e.status = 'failed') AS num_failed_episodes,
           COALESCE(sum(t.n), 0) AS num_trajectories,
           count(*)::float / sum(count(*)) OVER (PARTITION BY e.run_id) AS share,
           avg(e.reward) FILTER (WHERE e.status = 'completed') AS mean_reward,
           count(*) FILTER (WHERE e.status = 'error') AS num_errored_episodes,
           count(*) FILTER (WHERE e.status = 'completed') AS num_scored_episodes
    FROM episodes e LEFT JOIN (SELECT episode_id, count(*) AS n FROM trajectories GROUP BY episode_id) t
         ON t.episode_id = e.id
    GROUP BY e.run_id, e.termination_reason
"""

# Why attempts ended unscored, per run, most common first: a user-code error's ledger row holds
# "<where>: <exception>"; an infrastructure failure's reason is its error's last line.
ERROR_REASONS = """
    SELECT run_id, status AS outcome,
           CASE WHEN status = 'error' THEN split_part(error, E'\\n', 1)
                ELSE (regexp_match(rtrim(COALESCE(error, status), E'\\n\\t '), '[^\\n]*$'))[1] END AS reason,
           count(*) AS attempts, count(DISTINCT (task_id, sample_idx)) AS units,
           min(finished_at) AS first_at, max(finished_at) AS last_at
    FROM rollout_tasks WHERE status IN ('error', 'failed', 'lost')
    GROUP BY 1, 2, 3
"""

OLD_FAILURES = """
    SELECT e.run_id, e.termination_reason, count(*) AS num_episodes,
           count(*) FILTER (WHERE e.status = 'failed') AS num_failed_episodes,
           COALESCE(sum(t.n), 0) AS num_trajectories,
           count(*)::float / sum(count(*)) OVER (PARTITION BY e.run_id) AS share,
           avg(e.reward) AS mean_reward
    FROM episodes e LEFT JOIN (SELECT episode_id, count(*) AS n FROM trajectories GROUP BY episode_id) t
         ON t.episode_id = e.id
    GROUP BY e.run_id, e.termination_reason
"""
OLD_RUN_LEDGER = """
    WITH units AS (
        SELECT run_id, task_id, sample_idx, count(*) AS attempts,
               bool_or(status = 'completed') AS completed, bool_or(status = 'dispatched') AS in_flight,
               bool_or(status = 'cancelled') AS cancelled, count(*) FILTER (WHERE status IN ('failed', 'lost')) AS failures
        FROM rollout_tasks GROUP BY run_id, task_id, sample_idx
    ), unit_state AS (
        SELECT u.run_id, CASE
                   WHEN u.completed THEN 'completed' WHEN u.in_flight THEN 'in_flight'
                   WHEN u.cancelled THEN 'cancelled'
                   WHEN u.failures >= COALESCE((r.config ->> 'max_attempts')::int, 3)
                        OR r.status IN ('stopped', 'completed', 'failed') THEN 'failed'
                   ELSE 'retrying' END AS state
        FROM units u JOIN runs r ON r.id = u.run_id
    ), unit_counts AS (
        SELECT run_id, count(*) AS units_total,
               count(*) FILTER (WHERE state = 'completed') AS units_completed,
               count(*) FILTER (WHERE state = 'in_flight') AS units_in_flight,
               count(*) FILTER (WHERE state = 'retrying') AS units_retrying,
               count(*) FILTER (WHERE state = 'failed') AS units_failed,
               count(*) FILTER (WHERE state = 'cancelled') AS units_cancelled
        FROM unit_state GROUP BY run_id
    ), attempt_counts AS (
        SELECT run_id, count(*) AS attempts_total,
               count(*) FILTER (WHERE status = 'completed') AS attempts_completed,
               count(*) FILTER (WHERE status = 'dispatched') AS attempts_in_flight,
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
           COALESCE(a.attempts_lost, 0) AS attempts_lost, COALESCE(a.attempts_cancelled, 0) AS attempts_cancelled
    FROM runs r LEFT JOIN unit_counts u ON u.run_id = r.id LEFT JOIN attempt_counts a ON a.run_id = r.id
"""
READER = "flywheel_reader"


def _replace(views: dict[str, str]) -> None:
    for name, body in views.items():  # columns change, so CREATE OR REPLACE cannot be used
        op.execute(f"DROP VIEW IF EXISTS {name}")
        op.execute(f"CREATE VIEW {name} AS {body}")
        op.execute(f"GRANT SELECT ON {name} TO {READER}")


def upgrade() -> None:
    op.add_column("runs", sa.Column("stall_reason", sa.Text()))
    op.add_column("runs", sa.Column("stalled_since", sa.DateTime(timezone=True)))
    op.add_column("runs", sa.Column("warning", sa.Text()))
    _replace({"run_ledger": RUN_LEDGER, "failures_by_termination_reason": FAILURES,
              "run_error_reasons": ERROR_REASONS})


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS run_error_reasons")
    _replace({"run_ledger": OLD_RUN_LEDGER, "failures_by_termination_reason": OLD_FAILURES})
    op.drop_column("runs", "warning")
    op.drop_column("runs", "stalled_since")
    op.drop_column("runs", "stall_reason")
