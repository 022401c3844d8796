"""A rollout worker SIGKILLed mid-run loses nothing (its tasks are reclaimed by another worker), and hot
reload changes the served weights and the version tags without a restart."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest
import redis as sync_redis
from fixtures.rollout_stack import (
    collect_results,
    insert_checkpoint,
    insert_run,
    make_task,
    publish_tasks,
    run_config,
    weights_published,
)

from services.jobs.builtin_datasets import generate
from shared.contracts.streams import GROUP_ROLLOUT, ROLLOUT_TASKS, WEIGHTS
from shared.platform.bus import StreamBus, connect
from shared.weights.manifest import write_manifest
from tests.support.procs import start_service, stop, wait_heartbeat
from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    v0 = build_tiny_model(root / "v0", seed=0)
    v1 = build_tiny_model(root / "v1", seed=1)  # same tokenizer and shapes, other weights: "checkpoint 1"
    return v0, v1


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


def inflight(redis_url: str, worker_id: str) -> int:
    raw = sync_redis.Redis.from_url(redis_url).get(f"heartbeat:rollout-worker:{worker_id}")
    return json.loads(raw).get("inflight", 0) if raw else 0


async def test_killed_worker_tasks_are_reclaimed(redis_url, database_url, models, redis, tmp_path):
    env = start_service("services.env_worker.main", redis_url=redis_url, worker_id="env-k")
    common = dict(redis_url=redis_url, database_url=database_url, data_dir=str(tmp_path), claim_idle_ms="1500",
                  max_concurrency="4", heartbeat_interval_s="0.2")
    victim = start_service("services.rollout_worker.main", worker_id="victim", **common)
    survivor = None
    try:
        wait_heartbeat(redis_url, "env-worker", "env-k", env)
        wait_heartbeat(redis_url, "rollout-worker", "victim", victim)
        # long generations so that the victim is surely mid-trajectory when it dies
        run_id = insert_run(database_url, run_config(str(models[0]), max_response_tokens=96))
        tasks = [make_task(run_id, row) for row in generate("arithmetic", 10, seed=5)]
        await publish_tasks(redis, tasks)
        deadline = time.monotonic() + 60
        while inflight(redis_url, "victim") == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert inflight(redis_url, "victim") > 0
        victim.kill()  # SIGKILL: no drain, no acks
        victim.wait()
        pending = await redis.xpending(ROLLOUT_TASKS, GROUP_ROLLOUT)
        assert pending["pending"] > 0  # the victim died holding tasks
        survivor = start_service("services.rollout_worker.main", worker_id="survivor", **common)
        results = await collect_results(redis, run_id, expected=len(tasks), timeout_s=180)
        assert {r.task_id for r in results} == {t.task_id for t in tasks}
        assert all(r.status == "completed" for r in results)
        assert any(r.worker_id == "survivor" for r in results)
        for _ in range(50):
            if (await redis.xpending(ROLLOUT_TASKS, GROUP_ROLLOUT))["pending"] == 0:
                break
            await asyncio.sleep(0.1)
        assert (await redis.xpending(ROLLOUT_TASKS, GROUP_ROLLOUT))["pending"] == 0
    finally:
        print((stop(victim) + (stop(survivor) if survivor else "") + stop(env))[-4000:])


async def test_hot_reload_changes_weights_and_versions(redis_url, database_url, models, redis, tmp_path):
    v0, v1 = models
    ckpt = tmp_path / "ckpt-v1"
    shutil.copytree(v1, ckpt)
    _, sha = write_manifest(ckpt, "x", 1)
    env = start_service("services.env_worker.main", redis_url=redis_url, worker_id="env-h")
    worker = start_service("services.rollout_worker.main", worker_id="reloader", redis_url=redis_url,
                           database_url=database_url, data_dir=str(tmp_path / "data"))
    try:
        wait_heartbeat(redis_url, "env-worker", "env-h", env)
        wait_heartbeat(redis_url, "rollout-worker", "reloader", worker)
        run_id = insert_run(database_url, run_config(str(v0)))
        before = await probe(redis, run_id, "before")
        assert before.trajectories[0].steps[0].weight_version == 0
        bus = StreamBus(redis)
        await bus.publish(WEIGHTS, weights_published(run_id, 1, ckpt, sha))
        after = await probe_until_version(redis, run_id, 1)
        step0, step1 = before.trajectories[0].steps[0], after.trajectories[0].steps[0]
        assert step0.prompt_ids == step1.prompt_ids  # same prompt, greedy decoding ...
        assert step0.logprobs != step1.logprobs  # ... other weights
        assert set(after.trajectories[0].versions) <= {1, -1}
        # a checkpoint whose checksum does not match is refused; version 1 keeps serving
        await bus.publish(WEIGHTS, weights_published(run_id, 2, ckpt, "0" * 64))
        await asyncio.sleep(1.0)
        again = await probe(redis, run_id, "after-bad")
        assert again.trajectories[0].steps[0].weight_version == 1
        assert again.trajectories[0].steps[0].logprobs == step1.logprobs
        # a run seen for the first time starts from its newest checkpoint in Postgres
        fresh = insert_run(database_url, run_config(str(v0)))
        insert_checkpoint(database_url, fresh, 1, str(ckpt), sha, 0)
        first = await probe(redis, fresh, "fresh")
        assert first.trajectories[0].steps[0].weight_version == 1
        assert first.trajectories[0].steps[0].logprobs == step1.logprobs
    finally:
        print((stop(worker) + stop(env))[-4000:])


async def probe(redis, run_id: str, name: str):
    task = make_task(run_id, {**generate("arithmetic", 1, seed=9)[0], "id": name}, greedy=True)
    await publish_tasks(redis, [task])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for r in await collect_results(redis, run_id, expected=1, timeout_s=90):
            if r.task_id == name:
                assert r.status == "completed", r.error
                return r
        await asyncio.sleep(0.1)
    raise TimeoutError(name)


async def probe_until_version(redis, run_id: str, version: int):
    for i in range(40):
        result = await probe(redis, run_id, f"probe-{version}-{i}")
        if result.trajectories[0].steps[0].weight_version == version:
            return result
        await asyncio.sleep(0.25)
    raise AssertionError(f"version {version} never served")
