"""shared/platform/heartbeats.py, the one reader of heartbeats, against a real Redis: the sync and asyncio readers see the
same live processes of one service, typed; malformed heartbeats are skipped; a Redis that is down raises
RedisError for the caller to judge.

    pytest -q tests/component/test_live_workers.py
"""

from __future__ import annotations

import json

import pytest

from shared.contracts.streams import heartbeat_key
from shared.platform.bus import RedisError, connect, connect_sync
from shared.platform.heartbeats import Heartbeat, live_workers, live_workers_async

BEATS = {
    heartbeat_key("rollout-worker", "a"): {"service": "rollout-worker", "worker_id": "a", "pid": 11, "port": 9001,
                                           "uptime_s": 3.5, "stopping": False, "engines": ["hf", "openai"],
                                           "max_concurrency": 8, "inflight": 3, "runs": 2,
                                           "gateway_url": "http://10.0.0.1:7000"},
    heartbeat_key("rollout-worker", "b"): {"service": "rollout-worker", "worker_id": "b", "stopping": True},
    heartbeat_key("rollout-worker", "garbage"): "not json {",
    heartbeat_key("rollout-worker", "a-list"): [1, 2],
    heartbeat_key("rollout-worker", "bad-engines"): {"engines": "hf"},
    heartbeat_key("env-worker", "e"): {"service": "env-worker", "worker_id": "e", "sessions": 4},
}


@pytest.fixture
def beats(redis_url):
    client = connect_sync(redis_url)
    client.flushdb()
    for key, value in BEATS.items():
        client.set(key, value if isinstance(value, str) else json.dumps(value), ex=60)
    yield client
    client.flushdb()
    client.close()


def by_id(workers: list[Heartbeat]) -> dict[str, Heartbeat]:
    return {w.worker_id: w for w in workers}


async def test_sync_and_async_readers_see_the_same_typed_heartbeats(beats, redis_url):
    workers = by_id(live_workers(beats, "rollout-worker"))
    assert set(workers) == {"a", "b"}  # the malformed three are skipped, the env worker is another service
    a = workers["a"]
    assert (a.engines, a.max_concurrency, a.inflight, a.gateway_url, a.port) == (
        ["hf", "openai"], 8, 3, "http://10.0.0.1:7000", 9001)
    assert a.model_extra == {"runs": 2}  # status entries the model does not name are kept
    b = workers["b"]
    assert b.stopping and b.engines is None and b.gateway_url is None and b.max_concurrency == 0
    client = connect(redis_url)
    try:
        assert by_id(await live_workers_async(client, "rollout-worker")) == workers
        envs = await live_workers_async(client, "env-worker")
    finally:
        await client.aclose()
    assert [(w.worker_id, w.model_extra) for w in envs] == [("e", {"sessions": 4})]


def test_no_heartbeat_is_no_worker(redis_url):
    client = connect_sync(redis_url)
    client.flushdb()
    assert live_workers(client, "rollout-worker") == []


def test_redis_down_raises_redis_error():
    client = connect_sync("redis://127.0.0.1:1/0", timeout_s=1)  # nothing listens on port 1
    with pytest.raises(RedisError):
        live_workers(client, "rollout-worker")
