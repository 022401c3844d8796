"""SQL for users: stable views over stored trajectories and the read-only role `flywheel_reader`.

Roles are cluster-wide while this migration runs per database (tests migrate many databases at once), so the
role is created only when missing, races on creation are tolerated, and downgrade revokes this database's
grants but leaves the role (other databases may still use it).

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

READER = "flywheel_reader"

VIEWS = {
    # One row per stored trajectory with its run, correctness and sizes.
    "trajectory_summary": """
        SELECT t.id AS trajectory_id, t.run_id, r.name AS run_name, r.kind AS run_kind, t.task_id, t.sample_idx,
               t.attempt, t.traj_idx, t.name AS agent_name, t.reward, e.is_correct, t.termination_reason,
               t.num_steps, t.prompt_tokens, t.response_tokens, t.prompt_tokens + t.response_tokens AS total_tokens,
               t.policy_version_min, t.policy_version_max,
               COALESCE(t.policy_version_max - t.policy_version_min, 0) AS version_span, t.mismatch,
               EXTRACT(EPOCH FROM (e.finished_at - e.started_at)) AS duration_s, e.worker_id, t.created_at
        FROM trajectories t JOIN episodes e ON e.id = t.episode_id JOIN runs r ON r.id = t.run_id
    """,
    # Learning curve: reward and pass rate per policy version (the newest version that wrote tokens).
    "reward_by_policy_version": """
        SELECT t.run_id, t.policy_version_max AS policy_version, count(*) AS num_trajectories,
               avg(t.reward) AS mean_reward, stddev_samp(t.reward) AS std_reward,
               min(t.reward) AS min_reward, max(t.reward) AS max_reward,
               avg(CASE WHEN e.is_correct THEN 1.0 ELSE 0.0 END) AS pass_rate,
               avg(t.response_tokens) AS mean_response_tokens
        FROM trajectories t JOIN episodes e ON e.id = t.episode_id
        GROUP BY t.run_id, t.policy_version_max
    """,
    # Why trajectories ended, per run, with each reason's share.
    "failures_by_termination_reason": """
        SELECT run_id, termination_reason, count(*) AS num_trajectories,
               count(*)::float / sum(count(*)) OVER (PARTITION BY run_id) AS share,
               avg(reward) AS mean_reward
        FROM trajectories
        GROUP BY run_id, termination_reason
    """,
    # Per-task pass rate over all completed samples (pass@1 estimate) and whether any sample passed.
    "task_pass_rate": """
        SELECT run_id, task_id, count(*) AS num_samples, count(*) FILTER (WHERE is_correct) AS num_correct,
               avg(CASE WHEN is_correct THEN 1.0 ELSE 0.0 END) AS pass_rate,
               bool_or(is_correct) AS any_correct, avg(reward) AS mean_reward
        FROM episodes
        WHERE status = 'completed'
        GROUP BY run_id, task_id
    """,
    # The dispatched-task ledger per run: how much work is in flight, done, failed, lost.
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
    # One row per run: status, version, trajectories, mean reward, tokens.
    "run_overview": """
        SELECT r.id AS run_id, r.name, r.kind, r.status, r.policy_version, r.created_at, r.started_at,
               r.finished_at, count(t.id) AS num_trajectories, avg(t.reward) AS mean_reward,
               COALESCE(sum(t.prompt_tokens + t.response_tokens), 0) AS total_tokens
        FROM runs r LEFT JOIN trajectories t ON t.run_id = r.id
        GROUP BY r.id
    """,
    # Metrics in wide-ish form: the latest value of each metric per run.
    "latest_metrics": """
        SELECT DISTINCT ON (run_id, name) run_id, name, step, value, ts
        FROM metrics
        ORDER BY run_id, name, step DESC, id DESC
    """,
}

CREATE_ROLE = f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER}') THEN
        BEGIN
            CREATE ROLE {READER} NOLOGIN;
            ALTER ROLE {READER} SET statement_timeout = '30s';
            ALTER ROLE {READER} SET default_transaction_read_only = on;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- another database's migration created it at the same moment
        END;
    END IF;
END
$$;
"""


def upgrade() -> None:
    for name, body in VIEWS.items():
        op.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")
    op.execute(CREATE_ROLE)
    op.execute(f"DO $$ BEGIN EXECUTE format('GRANT CONNECT ON DATABASE %I TO {READER}', current_database()); END $$;")
    op.execute(f"GRANT USAGE ON SCHEMA public TO {READER}")
    op.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {READER}")
    op.execute(f"REVOKE SELECT ON api_tokens FROM {READER}")  # token hashes are not for readers
    op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {READER}")


def downgrade() -> None:
    op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE SELECT ON TABLES FROM {READER}")
    op.execute(f"REVOKE SELECT ON ALL TABLES IN SCHEMA public FROM {READER}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {READER}")
    op.execute(f"DO $$ BEGIN EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM {READER}', current_database()); END $$;")
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW IF EXISTS {name}")
