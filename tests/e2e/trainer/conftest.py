"""The trainer as a real process (tests/trainer_service_testlib.py): each module its own Postgres database and a
flushed Redis database, the tiny digit model, and a weight server per test."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text
from trainer_testlib import WeightServer

from infra.local.servers import scratch_database
from shared.contracts.streams import ACCEPTED_RESULTS, ROLLOUT_TASKS, TRAINER_PROGRESS, TRAJECTORIES, WEIGHTS
from tests.support.tiny_model import build_number_model


@pytest.fixture(scope="module")
def database_url(pg_admin_url):
    """This module's own database: runs left `running` by earlier modules would be leased by the trainer."""
    with scratch_database(pg_admin_url, migrate=True) as url:
        yield url


@pytest.fixture(scope="module")
def redis_url(redis_url):
    """The session's Redis database, flushed: no stream groups or trainer leases from earlier modules."""
    redis.Redis.from_url(redis_url).flushdb()
    return redis_url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_number_model(tmp_path_factory.mktemp("model") / "digit")


@pytest.fixture
def stack(redis_url, database_url, tmp_path):
    client = redis.Redis.from_url(redis_url)
    client.delete(TRAJECTORIES, WEIGHTS, ROLLOUT_TASKS, ACCEPTED_RESULTS, TRAINER_PROGRESS)
    ws = WeightServer(redis_url, database_url, tmp_path / "weights", keep_last=10).start()
    yield ws
    ws.stop()


@pytest.fixture(autouse=True)
def stop_runs(database_url):
    yield  # the database lives for the session: leave no run for the next test's trainer
    with create_engine(database_url).begin() as c:
        c.execute(text("UPDATE runs SET status = 'stopped' WHERE status = 'running'"))
