"""README.md's section "Querying trajectories with SQL": every ```sql block runs against stored runs as the read-only
role and returns rows; the reader cannot write or read token hashes, and long queries hit the timeout.

    pytest -q tests/integration/test_sql_docs.py
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest
from api_testlib import seed_run
from sqlalchemy.engine import make_url

DOC = Path(__file__).resolve().parents[2] / "README.md"


def doc_queries() -> list[str]:
    section = DOC.read_text().split("## Querying trajectories with SQL", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sql\n(.*?)```", section, flags=re.S)


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
    seed_run(database_url, name="sql-docs-a", num_tasks=3, samples=2, versions=3)
    seed_run(database_url, name="sql-docs-b", status="completed", num_tasks=2, samples=2, versions=2)


def test_docs_have_queries():
    assert len(doc_queries()) >= 6


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
