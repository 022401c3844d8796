"""docs/sql.md: every ```sql block runs against stored runs as the read-only
role and returns rows (the metric names it uses are the trainer's); `run_ledger` counts units and attempts that
add up, `failures_by_termination_reason` counts infrastructure failures; the reader cannot write or read token
hashes, and long queries hit the timeout.

    pytest -q tests/component/test_sql_docs.py
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest
from api_testlib import seed_run
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from shared.contracts.db.models import EpisodeRow, RolloutTaskRow, Run
from shared.contracts.tinker_run import TinkerRunConfig

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # every query, wherever it is documented


def doc_queries() -> list[str]:
    return [q for doc in DOCS for q in re.findall(r"```sql\n(.*?)```", doc.read_text(), flags=re.S)]


def reader(database_url: str) -> psycopg.Connection:
    """A session switched to flywheel_reader, with the role's own settings applied as a login would get them."""
    conn = psycopg.connect(make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False))
    conn.execute("SET ROLE flywheel_reader")
    for setting in conn.execute("SELECT unnest(setconfig) FROM pg_db_role_setting s JOIN pg_roles r "
                                "ON r.oid = s.setrole WHERE r.rolname = 'flywheel_reader'").fetchall():
        name, _, value = setting[0].partition("=")
        conn.execute(f"SET {name} = '{value}'")
    conn.commit()
    return conn


@pytest.fixture(scope="module")
def stored(database_url):
    a = seed_run(database_url, name="sql-docs-a", num_tasks=3, samples=2, versions=3)
    seed_run(database_url, name="sql-docs-b", status="completed", num_tasks=2, samples=2, versions=2)
    stopped = seed_run(database_url, name="sql-docs-stopped", status="stopped", num_tasks=1, samples=2, versions=1)
    tinker = seed_run(database_url, name="sql-docs-tinker", kind="tinker", num_tasks=1, samples=2, versions=1)
    engine = create_engine(database_url)
    with Session(engine) as s:  # a Tinker client's run (docs/tinker.md): its config is a TinkerRunConfig
        s.get(Run, tinker).config = TinkerRunConfig(
            name="sql-docs-tinker", model_id="s:train:0", session_id="s", owner="0" * 64, owner_name="sql-docs",
            base_model="tiny", model="tiny", lora={"rank": 8}).model_dump(mode="json")
        s.commit()
    with Session(engine) as s:
        # out of attempts (failed, lost, failed); retried then completed; in flight; cancelled by a stop
        for task, attempts in (("t-out", ["failed", "lost", "failed"]), ("t-retried", ["failed", "completed"]),
                               ("t-busy", ["dispatched"])):
            for i, status in enumerate(attempts):
                s.add(RolloutTaskRow(run_id=a, task_id=task, sample_idx=0, attempt=i, status=status))
                if status in ("failed", "completed"):
                    s.add(EpisodeRow(run_id=a, task_id=task, sample_idx=0, attempt=i, status=status,
                                     termination_reason="infra_error" if status == "failed" else "env_done",
                                     task={}, metrics={}, info={}, error="boom" if status == "failed" else None))
        s.add(RolloutTaskRow(run_id=stopped, task_id="t-stopped", sample_idx=0, attempt=0, status="cancelled"))
        s.commit()
    engine.dispose()
    return a


def test_docs_have_queries():
    assert len(doc_queries()) >= 6


def test_documented_metric_names_are_the_trainers():
    """A query over names the trainer never writes returns nothing: the documented names must be in the trainer's
    metrics (services/trainer/learner.py), and the seeded runs use the same names."""
    import torch
    from api_testlib import trainer_metrics

    from services.trainer.algorithm import rollout_correction
    from shared.contracts.run_config import AlgorithmConfig

    trainer = "".join((REPO / f"services/trainer/{f}.py").read_text() for f in ("learner", "loop"))
    verl_names = set(rollout_correction(-torch.ones(1, 2), -torch.ones(1, 2), torch.ones(1, 2), AlgorithmConfig())[2])
    names = set(re.findall(r"name = '([\w/]+)'", "\n".join(doc_queries())))
    assert {"ppo_kl", "entropy"} <= names
    for name in names | {n for n, _ in trainer_metrics(0)}:
        assert f'"{name}"' in trainer or name in verl_names, f"the trainer writes no metric {name!r}"


def test_run_ledger_counts_units_and_attempts_that_add_up(stored, database_url):
    with reader(database_url) as conn:
        every = conn.execute(
            "SELECT run_name, units_total, units_completed, units_in_flight, units_retrying, units_errored, "
            "units_failed, units_cancelled, attempts_total, attempts_completed, attempts_in_flight, "
            "attempts_errored, attempts_failed, attempts_lost, attempts_cancelled FROM run_ledger").fetchall()
    for name, ut, *units_and_attempts in every:  # every run of the session's database, errored units included
        units, (at, *attempts) = units_and_attempts[:6], units_and_attempts[6:]
        assert sum(units) == ut and sum(attempts) == at, (name, ut, units_and_attempts)
    rows = {r[0]: r for r in every}
    # 18 seeded units completed first time, t-retried completed on its 2nd attempt, t-out out of attempts
    assert rows["sql-docs-a"][1:] == (21, 19, 1, 0, 0, 1, 0, 24, 19, 1, 0, 3, 1, 0)
    assert rows["sql-docs-stopped"][1:8] == (3, 2, 0, 0, 0, 0, 1)


def test_failures_by_reason_counts_infrastructure_failures(stored, database_url):
    with reader(database_url) as conn:
        row = conn.execute("SELECT num_episodes, num_failed_episodes, num_trajectories FROM "
                           "failures_by_termination_reason WHERE run_id = %s AND termination_reason = 'infra_error'",
                           [stored]).fetchone()
    assert row == (3, 3, 0)


@pytest.mark.parametrize("query", doc_queries())
def test_documented_query_runs_as_reader(stored, database_url, query):
    with reader(database_url) as conn:
        rows = conn.execute(query).fetchall()
    assert rows, query


def test_reader_cannot_write(stored, database_url):
    with reader(database_url) as conn:
        for statement in ("DELETE FROM runs", "UPDATE runs SET status = 'failed'", "CREATE TABLE x (a int)"):
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                conn.execute(statement)
            conn.rollback()
        conn.execute("SET default_transaction_read_only = off")  # even with read-write transactions
        conn.commit()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM runs")
        conn.rollback()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT token_sha256 FROM api_tokens")


def test_reader_statement_timeout(stored, database_url):
    with reader(database_url) as conn:
        assert conn.execute("SHOW statement_timeout").fetchone()[0] == "30s"
        conn.execute("SET statement_timeout = '200ms'")  # the role's 30 s, shortened to keep the test fast
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(5)")
