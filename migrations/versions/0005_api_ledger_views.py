"""Views that add up: `run_ledger` counts (task, sample) units and dispatched attempts separately (each set of
columns sums to its total, cancelled included); `failures_by_termination_reason` counts every stored episode,
infrastructure failures (`infra_error`, no trajectory) included.

Revision ID: 0003_api
Revises: 0003_stack
"""

from alembic import op

revision = "0003_api"
down_revision = "0003_stack"
branch_labels = None
depends_on = None

# A unit is one (task, sample) of a run; the ledger holds one row per dispatched attempt of it. A unit is, in
# this order of precedence: completed (some attempt completed), in_flight (an attempt is out), cancelled (the run
# was stopped with it unfinished), failed (out of attempts, or the run ended without finishing it) or retrying
# (an attempt failed or was lost and the controller will dispatch another).
RUN_LEDGER = """
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

# Every stored episode (one per attempt that returned a result) by why it ended; infrastructure failures are
# episodes with status `failed` and reason `infra_error` and no trajectory. Lost attempts returned nothing.
FAILURES = """
    SELECT e.run_id, e.termination_reason, count(*) AS num_episodes,
           count(*) FILTER (WHERE e.status = 'failed') AS num_failed_episodes,
           COALESCE(sum(t.n), 0) AS num_trajectories,
           count(*)::float / sum(count(*)) OVER (PARTITION BY e.run_id) AS share,
           avg(e.reward) AS mean_reward
    FROM episodes e LEFT JOIN (SELECT episode_id, count(*) AS n FROM trajectories GROUP BY episode_id) t
         ON t.episode_id = e.id
    GROUP BY e.run_id, e.termination_reason
"""

OLD = {
    "run_ledger": """
        SELECT r.id AS run_id, r.name AS run_name, r.status AS run_status,
               count(lt.run_id) FILTER (WHERE lt.status = 'dispatched') AS in_flight,
               count(lt.run_id) FILTER (WHERE lt.status = 'completed') AS completed,
               count(lt.run_id) FILTER (WHERE lt.status = 'failed') AS failed,
               count(lt.run_id) FILTER (WHERE lt.status = 'lost') AS lost,
               count(lt.run_id) AS dispatched_total
        FROM runs r LEFT JOIN rollout_tasks lt ON lt.run_id = r.id
        GROUP BY r.id, r.name, r.status
    """,
    "failures_by_termination_reason": """
        SELECT run_id, termination_reason, count(*) AS num_trajectories,
               count(*)::float / sum(count(*)) OVER (PARTITION BY run_id) AS share,
               avg(reward) AS mean_reward
        FROM trajectories
        GROUP BY run_id, termination_reason
    """,
}
READER = "flywheel_reader"


def _replace(views: dict[str, str]) -> None:
    for name, body in views.items():  # columns change, so CREATE OR REPLACE cannot be used
        op.execute(f"DROP VIEW IF EXISTS {name}")
        op.execute(f"CREATE VIEW {name} AS {body}")
        op.execute(f"GRANT SELECT ON {name} TO {READER}")


def upgrade() -> None:
    _replace({"run_ledger": RUN_LEDGER, "failures_by_termination_reason": FAILURES})


def downgrade() -> None:
    _replace(OLD)
