"""Migrations on a real Postgres: `upgrade head` builds exactly the models' schema, `downgrade base` removes it,
and the models never drift from the migrations (autogenerate finds nothing to do).

    pytest -q tests/component/test_migrations.py
"""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from shared.contracts.db.models import Base
from shared.platform.db.migrate import downgrade, upgrade


def user_tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return set(inspect(c).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def user_types(url: str) -> set[str]:
    """Enum types in the schema (a downgrade must drop them with their tables)."""
    engine = create_engine(url)
    sql = text(
        "SELECT t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
        "WHERE n.nspname = 'public' AND t.typtype = 'e'"
    )
    try:
        with engine.connect() as c:
            return set(c.scalars(sql))
    finally:
        engine.dispose()


def schema_drift(url: str) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            ctx = MigrationContext.configure(c, opts={"compare_type": True})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_database_url):
    assert user_tables(empty_database_url) == set()

    upgrade(empty_database_url)
    assert user_tables(empty_database_url) == set(Base.metadata.tables)

    downgrade(empty_database_url, "base")
    assert user_tables(empty_database_url) == set()
    assert user_types(empty_database_url) == set()

    upgrade(empty_database_url)
    assert user_tables(empty_database_url) == set(Base.metadata.tables)


def test_models_match_migrations(database_url):
    drift = schema_drift(database_url)
    assert drift == [], f"models and migrations differ; write a new revision for: {drift}"
