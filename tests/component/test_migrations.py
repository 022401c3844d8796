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


def test_linear_step_storage_keeps_every_step_across_upgrade_and_downgrade(pg_admin_url):
    """0012 (the stream and each message stored once) on data: steps stored whole before it read the same
    through its views, and a downgrade stores every step whole again, its chat and arrays as the views read."""
    import uuid

    from sqlalchemy import insert

    from infra.local.servers import scratch_database
    from services.controller.store import TrajectoryStore
    from shared.contracts.db.models import RolloutTaskRow, Run
    from shared.contracts.messages import EpisodeResult
    from tests.support.multi_turn import multi_turn

    def read(url: str) -> list[tuple]:
        engine = create_engine(url)
        with engine.connect() as c:
            rows = c.execute(text("SELECT s.step_idx, s.chat_completions, a.prompt_ids, a.response_ids FROM steps s "
                                  "JOIN token_arrays a USING (trajectory_id, step_idx) ORDER BY 1")).all()
        engine.dispose()
        return [tuple(r) for r in rows]

    with scratch_database(pg_admin_url, migrate=False) as url:
        upgrade(url)
        engine = create_engine(url)
        run = uuid.uuid4()
        with engine.begin() as c:
            c.execute(insert(Run).values(id=run, name="t", kind="eval", status="running", config={}))
            c.execute(insert(RolloutTaskRow).values(run_id=run, task_id="t", sample_idx=0, attempt=0, batch_idx=0,
                                                    status="dispatched", epoch=0, greedy=False, dispatch_version=0))
        traj = multi_turn(6, rewrite_at=3, off_stream=4)
        TrajectoryStore(engine).write([EpisodeResult(run_id=str(run), task_id="t", sample_idx=0, status="completed",
                                                     termination_reason="env_done", trajectories=[traj])])
        engine.dispose()
        expected = [(k, s.chat_completions, s.prompt_ids, s.response_ids) for k, s in enumerate(traj.steps)]
        assert read(url) == expected
        downgrade(url, "0011_ledger_published_at")
        assert read(url) == expected  # tables again, every row whole
        upgrade(url)
        assert read(url) == expected  # kept whole through the views
