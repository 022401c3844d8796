"""A Tinker sample its client cancelled (`cancel_future`) is dropped by the rollout worker, before or while it is
generated (services/rollout_worker/tinker_sampling.py), against a real Redis."""

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from services.rollout_worker.tinker_sampling import SampleCancelled, unless_cancelled
from shared.contracts.streams import tinker_key


@pytest.fixture
async def redis_client(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_work_is_cancelled_once_its_client_cancels_the_request(redis_client):
    request_id, ended = str(uuid.uuid4()), asyncio.Event()

    async def long_generation():
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    async def cancel_soon():
        await asyncio.sleep(0.3)
        await redis_client.set(tinker_key("cancelled", request_id), "1", ex=60)

    canceller = asyncio.ensure_future(cancel_soon())
    with pytest.raises(SampleCancelled) as raised:
        await asyncio.wait_for(unless_cancelled(redis_client, request_id, long_generation, poll_s=0.05), 10)
    await canceller
    assert raised.value.started and ended.is_set()  # the generation itself was stopped, not left running


async def test_a_request_cancelled_before_it_is_served_never_starts(redis_client):
    request_id, started = str(uuid.uuid4()), []
    await redis_client.set(tinker_key("cancelled", request_id), "1", ex=60)

    async def generation():
        started.append(1)

    with pytest.raises(SampleCancelled) as raised:
        await unless_cancelled(redis_client, request_id, generation)
    assert not raised.value.started and started == []


async def test_work_not_cancelled_returns_its_result(redis_client):
    async def generation():
        await asyncio.sleep(0.2)
        return "sampled"

    assert await unless_cancelled(redis_client, str(uuid.uuid4()), generation, poll_s=0.05) == "sampled"


async def test_while_redis_cannot_be_read_the_work_goes_on():
    unreachable = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)

    async def generation():
        await asyncio.sleep(0.3)
        return "sampled"

    try:
        assert await unless_cancelled(unreachable, str(uuid.uuid4()), generation, poll_s=0.05) == "sampled"
    finally:
        await unreachable.aclose()
