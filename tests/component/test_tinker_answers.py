"""The Tinker trainer against real Redis: an operation it applied is answered even across a Redis outage
(TinkerModels.answer and the writes before it wait for Redis instead of failing the trainer's loop; a
redis-server stopped and started again), and its scan for models whose holder died sees which model streams
have operations waiting. And the rollout worker's side: a sample request dead-lettered (workers died serving it)
is answered with the reason, so its client's future fails instead of waiting for ever."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from infra.local.servers import RedisServer
from services.rollout_worker.tinker_sampling import TinkerSampling
from services.trainer.tinker_models import TinkerModels
from shared.contracts.messages import TinkerFuture, TinkerOp, TinkerSample
from shared.contracts.streams import GROUP_ROLLOUT, TINKER_SAMPLES, tinker_key
from shared.contracts.tinker_run import completion_queue
from shared.platform.bus import Redis, StreamBus


async def test_an_answer_written_while_redis_is_down_lands_once_it_is_back(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    redis = Redis.from_url(server.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    models = object.__new__(TinkerModels)  # answer() writes only to the trainer's Redis
    models.trainer, models.models = SimpleNamespace(redis=redis), {}
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


async def test_the_scan_for_unheld_models_sees_which_streams_have_operations_waiting(redis_url):
    """`waiting`: a model's stream with an entry never read, or read and not acknowledged (a dead holder's), has
    work; one fully acknowledged, or absent, has none."""
    redis = Redis.from_url(redis_url)
    models = object.__new__(TinkerModels)
    models.trainer = SimpleNamespace(redis=redis)
    names = {k: f"tinker.ops.test-waiting-{k}" for k in ("absent", "unread", "pending", "answered", "no_group")}
    try:
        await redis.delete(*names.values())
        for k in ("unread", "pending", "answered"):
            await redis.xgroup_create(names[k], "train", id="0", mkstream=True)
            await redis.xadd(names[k], {"x": "1"})
        await redis.xadd(names["no_group"], {"x": "1"})
        for k in ("pending", "answered"):
            read = await redis.xreadgroup("train", "dead-trainer", {names[k]: ">"})
            if k == "answered":
                await redis.xack(names[k], "train", read[0][1][0][0])
        got = dict(zip(names, await models.waiting(list(names.values())), strict=True))
        assert got == {"absent": False, "unread": True, "pending": True, "answered": False, "no_group": True}
    finally:
        await redis.delete(*names.values())
        await redis.aclose()


async def test_a_sample_request_that_kills_its_workers_is_answered_once_dead_lettered(tmp_path):
    server = RedisServer(tmp_path / "redis")  # a Redis of its own: the sampler reads the fleet's one stream
    server.start()
    redis = Redis.from_url(server.url)
    cfg = SimpleNamespace(max_deliveries=2, claim_idle_ms=100, read_block_ms=50, max_concurrency=4)
    sampling = TinkerSampling(SimpleNamespace(bus=StreamBus(redis), cfg=cfg, worker_id="rollout-live"))
    completions = completion_queue("session-1:sample:0", 0)
    try:
        await sampling.start()
        await sampling.worker.bus.publish(TINKER_SAMPLES, TinkerSample(
            request_id="req-poison", owner="o", run_id="r", sequence_ids=["req-poison:0"], prompt=[1, 2, 3],
            num_samples=1, max_tokens=4, completions=completions))
        # three workers took it in turn and died before answering it
        [[_, [(entry_id, _)]]] = await redis.xreadgroup(GROUP_ROLLOUT, "rollout-dead-0", {TINKER_SAMPLES: ">"})
        for dead in ("rollout-dead-1", "rollout-dead-2"):
            await redis.xclaim(TINKER_SAMPLES, GROUP_ROLLOUT, dead, 0, [entry_id])
        await asyncio.sleep(0.2)  # idle past claim_idle_ms: a live worker claims it, and gives it up
        assert await sampling.consumer.read() == []
        future = TinkerFuture.model_validate_json(await redis.get(tinker_key("future", "req-poison")))
        assert future.result["category"] == "server" and "given up" in future.result["error"]
        assert "delivered 4 times" in future.result["error"], future.result
        [(_, fields)] = await redis.xrange(completions)
        assert (fields[b"request_id"], fields[b"state"]) == (b"req-poison", b"failed")  # the poller learns it
        assert not await redis.keys("tinker:usage:*")  # nothing served, nothing counted
    finally:
        await redis.aclose()
        server.stop()
