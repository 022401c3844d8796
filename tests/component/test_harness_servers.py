"""The embedded servers of the harness keep the promises the stack's supervisor and the chaos scenarios rely
on: a restart serves the same data at the same URL, a wipe empties it, stop() is safe twice.

    pytest -q tests/component/test_harness_servers.py
"""

from __future__ import annotations

import signal

import pytest
import redis
from sqlalchemy import create_engine, text

from infra.local.servers import PostgresServer, RedisServer


@pytest.mark.parametrize("unix_socket", [False, True], ids=["tcp", "unix"])
def test_redis_restarts_with_its_data_at_the_same_url_and_wipe_empties_it(tmp_path, unix_socket):
    server = RedisServer(tmp_path / "redis", unix_socket=unix_socket)
    server.start()
    try:
        url = server.url
        redis.Redis.from_url(url).xadd("s", {"k": "v"})
        server.stop(signal.SIGTERM)
        assert not server.alive
        server.start()
        assert server.url == url and redis.Redis.from_url(url).xlen("s") == 1  # AOF replayed
        server.stop(signal.SIGKILL)
        server.wipe()
        server.start()
        assert server.url == url and redis.Redis.from_url(url).xlen("s") == 0
    finally:
        server.stop()
        server.stop()  # twice is harmless
    assert not server.alive


def test_postgres_restarts_with_its_data_at_the_same_url(tmp_path):
    server = PostgresServer(tmp_path / "pg")
    server.start()
    try:
        url = server.url
        engine = create_engine(url)
        with engine.begin() as c:
            c.execute(text("CREATE TABLE kept (v int)"))
            c.execute(text("INSERT INTO kept VALUES (7)"))
        engine.dispose()
        server.stop()
        assert not server.alive
        server.start()
        assert server.url == url
        engine = create_engine(url)
        with engine.connect() as c:
            assert c.execute(text("SELECT v FROM kept")).scalar_one() == 7
        engine.dispose()
    finally:
        server.stop()
        server.stop()
