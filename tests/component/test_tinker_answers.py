"""A Tinker operation the trainer applied is answered even across a Redis outage (TinkerModels.answer and the
writes before it wait for Redis instead of failing the trainer's loop), over a real redis-server that is stopped
and started again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from infra.local.servers import RedisServer
from services.trainer.tinker_models import TinkerModels
from shared.contracts.messages import TinkerFuture, TinkerOp
from shared.contracts.streams import tinker_key
from shared.platform.bus import Redis


async def test_an_answer_written_while_redis_is_down_lands_once_it_is_back(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    redis = Redis.from_url(server.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    models = object.__new__(TinkerModels)  # answer() writes only to the trainer's Redis
    models.trainer = SimpleNamespace(redis=redis)
    op = TinkerOp(request_id="req-1", owner="o", model_id="s:train:0", run_id="r", seq_id=1, op="optim_step")
    try:
        server.stop()
        answering = asyncio.create_task(models.answer(op, {"type": "optim_step", "metrics": {}}))
        await asyncio.sleep(1.5)
        assert not answering.done()  # waiting for Redis: neither given up nor raised
        server.start()
        await asyncio.wait_for(answering, 30)
        raw = await redis.get(tinker_key("future", "req-1"))
        assert TinkerFuture.model_validate_json(raw).result == {"type": "optim_step", "metrics": {}}
    finally:
        await redis.aclose()
        server.stop()
