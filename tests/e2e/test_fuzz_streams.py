"""Bad entries in every consumed stream, with the real services running (env worker, rollout worker,
controller, trainer as processes; mock LLM with the openai engine).

Into each stream go: random fields, a random body, missing t/v/d fields, a body missing the model's fields,
a truncated msgpack body, schema version 99, a message of another type, and an oversized entry (a valid
message over MAX_ENTRY_BYTES, set low here so the test stays light; the default is 16 MiB). Each must be:
- dead-lettered in `<stream>.dlq` with a reason (group readers), or skipped (readers without a group:
  `weights` and `env.replies.<rollout worker>`);
- counted in the reading service's /metrics;
- harmless: the service stays healthy, and valid work sent afterwards is processed (an evaluation run
  completes with nothing lost and none of its results reaches the trainer, a weights announcement is acted on).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import httpx
import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infra.local.stack import LocalStack
from shared.contracts.messages import (
    AcceptedResult,
    EnvReply,
    EnvRequest,
    EpisodeResult,
    RolloutTask,
    TrainerProgress,
    WeightsPublished,
    decode,
    encode,
)
from shared.contracts.streams import (
    ACCEPTED_RESULTS,
    ENV_REQUESTS,
    ROLLOUT_TASKS,
    TRAINER_PROGRESS,
    TRAJECTORIES,
    WEIGHTS,
    dead_letter,
    env_inbox,
    env_replies,
)
from shared.platform.bus import connect
from shared.sdk.types import TerminationReason
from tests.support.live import accounting, insert_run, mock_llm_stack, register_dataset, wait_run_ended

LIMIT = 256 * 1024  # MAX_ENTRY_BYTES of the services under test
ENV_ID, ROLLOUT_ID = "env-worker-0", "rollout-worker-0"
NOW = time.time()


def _samples(big: str = "") -> dict[str, object]:
    """One valid message per stream; `big` pads a free-form field to make it oversized."""
    return {
        ROLLOUT_TASKS: RolloutTask(run_id=str(uuid.uuid4()), task_id="t", sample_idx=0, task={"pad": big},
                                   dispatched_at=NOW),
        ENV_REQUESTS: EnvRequest(request_id="q", op="reset", session_id="s", run_id="r", env="math",
                                 task={"pad": big}, reply_to="fuzz.replies", sent_at=NOW),
        env_inbox(ENV_ID): EnvRequest(request_id="q", op="step", session_id="s", run_id="r", env="math",
                                      action=big, reply_to="fuzz.replies", sent_at=NOW),
        TRAJECTORIES: EpisodeResult(run_id=str(uuid.uuid4()), task_id="t", sample_idx=0, status="failed",
                                    termination_reason=TerminationReason.INFRA_ERROR, task={"pad": big}),
        ACCEPTED_RESULTS: AcceptedResult(run_id=str(uuid.uuid4()), task_id="t" + big, sample_idx=0, attempt=0,
                                         batch_idx=0),
        TRAINER_PROGRESS: TrainerProgress(run_id=str(uuid.uuid4()), version=0, groups=[
            {"task_id": "t" + big, "batch_idx": 0, "status": "filtered"}]),
        env_replies(ROLLOUT_ID): EnvReply(request_id="q", session_id="s", env_worker_id="e", ok=True,
                                          observation=big),
        WEIGHTS: WeightsPublished(run_id="r", version=1, uri="http://x/" + big, sha256="0" * 64, bytes=1,
                                  created_at=NOW),
    }


def bad_entries(stream: str) -> dict[str, dict[bytes, bytes]]:
    good = encode(_samples()[stream])
    other = RolloutTask if stream != ROLLOUT_TASKS else EnvReply
    wrong_type = encode(_samples()[ROLLOUT_TASKS if other is RolloutTask else env_replies(ROLLOUT_ID)])
    cases = {
        "random_fields": {b"junk": os.urandom(64)},
        "random_body": {**good, b"d": os.urandom(256)},
        "missing_fields": {b"t": good[b"t"], b"v": good[b"v"]},
        "missing_body_fields": {**good, b"d": msgpack.packb({"run_id": "r"})},
        "truncated": {**good, b"d": good[b"d"][: len(good[b"d"]) // 2]},
        "wrong_version": {**good, b"v": b"99"},
        "wrong_type": wrong_type,
        "oversized": encode(_samples(big="x" * (LIMIT + 1024))[stream]),  # valid but for its size
    }
    return {name: {**fields, b"fuzz_case": f"{stream}:{name}".encode()} for name, fields in cases.items()}


# stream -> (service instance that reads it, its consumer groups; none: reads without a group)
READERS = {
    ROLLOUT_TASKS: ("rollout-worker", ["rollout"]),
    ENV_REQUESTS: ("env-worker", ["env"]),
    env_inbox(ENV_ID): ("env-worker", ["env"]),
    TRAJECTORIES: ("controller", ["store"]),
    ACCEPTED_RESULTS: ("trainer", ["train"]),
    TRAINER_PROGRESS: ("controller", ["controller"]),
    env_replies(ROLLOUT_ID): ("rollout-worker", []),
    WEIGHTS: ("rollout-worker", []),
}


@pytest.fixture(scope="module")
def live(isolated_urls, tmp_path_factory):
    redis_url, database_url = isolated_urls
    with mock_llm_stack(tmp_path_factory.mktemp("fuzz"), redis_url, database_url,
                        ["env-worker", "rollout-worker", "trainer", "controller"],
                        env={"MAX_ENTRY_BYTES": str(LIMIT)}, healthy_s=120) as live:
        yield live | {"redis_url": redis_url}


def metric(stack: LocalStack, service: str, name: str, **labels: str) -> float:
    """Sum of a counter's samples in one service's /metrics whose labels include `labels`."""
    body = httpx.get(f"http://127.0.0.1:{stack.instance(service).port}/metrics", timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def assert_healthy(stack: LocalStack, service: str) -> None:
    inst = stack.instance(service)
    assert inst.alive, f"{service} died:\n{inst.log_tail()}"
    assert httpx.get(inst.health_url, timeout=5).status_code == 200


async def dlq_entries(redis, stream: str, cases: set[str], groups: list[str], timeout_s: float = 20) -> dict:
    """Wait until every case has a dead-letter entry per group; returns {(case, group): entry fields}."""
    found: dict[tuple[str, str], dict] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, fields in await redis.xrange(dead_letter(stream)):
            case = fields.get(b"fuzz_case", b"").decode().rpartition(":")[2]
            if case in cases:
                found[(case, fields.get(b"dlq_group", groups[0].encode()).decode())] = fields
        if len(found) >= len(cases) * len(groups):
            return found
        await asyncio.sleep(0.2)
    missing = {(c, g) for c in cases for g in groups} - set(found)
    raise AssertionError(f"no dead-letter entry on {dead_letter(stream)} for {sorted(missing)}")


async def wait_metric(stack, service, name, at_least: float, timeout_s: float = 20, **labels) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := metric(stack, service, name, **labels)) < at_least and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return value


@pytest.mark.parametrize("stream", [s for s, (_, groups) in READERS.items() if groups])
async def test_bad_entries_are_dead_lettered_with_a_reason_and_counted(live, stream):
    stack, (service, groups) = live["stack"], READERS[stream]
    redis = connect(live["redis_url"])
    cases = bad_entries(stream)
    for fields in cases.values():
        await redis.xadd(stream, fields)
    found = await dlq_entries(redis, stream, set(cases), groups)
    await redis.aclose()
    for (case, _), fields in found.items():
        assert fields[b"dlq_reason"], f"{case}: dead-lettered without a reason"
    for group in groups:
        assert b"exceeds the 262144-byte limit" in found[("oversized", group)][b"dlq_reason"]
        assert b"schema version 99" in found[("wrong_version", group)][b"dlq_reason"]
    for svc, group in [(service, groups[0])]:
        assert_healthy(stack, svc)
        counted = await wait_metric(stack, svc, "bus_messages_dead_lettered_total", len(cases), 3, stream=stream,
                                    group=group)  # counted when dead-lettered, so at once
        assert counted >= len(cases), f"{svc} counted {counted} dead letters on {stream}/{group}"


@pytest.mark.parametrize("stream", [s for s, (_, groups) in READERS.items() if not groups])
async def test_bad_entries_on_groupless_streams_are_skipped_and_counted(live, stream):
    stack, (service, _) = live["stack"], READERS[stream]
    redis = connect(live["redis_url"])
    cases = bad_entries(stream)
    for fields in cases.values():
        await redis.xadd(stream, fields)
    await redis.aclose()
    counted = await wait_metric(stack, service, "bus_messages_skipped_total", len(cases), 3, stream=stream)
    assert_healthy(stack, service)
    assert counted >= len(cases)


async def test_valid_work_is_still_processed_after_the_bad_entries(live):
    """Runs after the tests above (file order): every reader has seen its bad entries by now."""
    stack, engine = live["stack"], live["engine"]
    register_dataset(engine, "fuzz-arith", 4)
    run_id = insert_run(engine, {
        "name": "fuzz", "kind": "eval", "model": live["model"], "dataset": "fuzz-arith", "dataset_split": "test",
        "agent": {"name": "math"}, "env": {"name": "math"}, "samples_per_task": 2, "max_response_tokens": 16,
        "engine": {"type": "openai", "base_url": live["llm"], "request_timeout_s": 10, "max_retries": 1},
        "trajectory_timeout_s": 30, "max_in_flight": 8,
    })
    status = wait_run_ended(engine, run_id, 90)
    assert status == "completed", f"run {status}:\n{stack.instance('controller').log_tail()}"
    counts = accounting(engine, run_id)
    assert counts["stored"] == counts["dispatched"] == 8 and counts["lost"] == 0 and counts["duplicates"] == 0
    # an evaluation run's results are stored, never handed to the trainer
    redis = connect(live["redis_url"])
    handed = [decode(f) for _, f in await redis.xrange(ACCEPTED_RESULTS) if b"fuzz_case" not in f]
    await redis.aclose()
    assert not [m for m in handed if m.run_id == run_id]
    await _env_worker_serves_a_session(live["redis_url"])
    await _weights_announcement_is_read(stack, live["redis_url"], run_id)
    for service in ("env-worker", "rollout-worker", "controller", "trainer"):
        assert_healthy(stack, service)


async def _env_worker_serves_a_session(redis_url: str) -> None:
    redis = connect(redis_url)
    cursor = "$"
    for op, stream in (("reset", ENV_REQUESTS), ("step", env_inbox(ENV_ID))):
        req = EnvRequest(request_id=uuid.uuid4().hex, op=op, session_id="fuzz-ok", run_id="r", env="math",
                         task={"question": "What is 1 + 1?", "ground_truth": "2"}, action="\\boxed{2}",
                         reply_to="fuzz.replies", sent_at=time.time())
        if cursor == "$":
            cursor = (await redis.xinfo_stream("fuzz.replies"))["last-generated-id"] if await redis.exists(
                "fuzz.replies") else "0-0"
        await redis.xadd(stream, encode(req))
        resp = await redis.xread({"fuzz.replies": cursor}, block=10_000)
        assert resp, f"no reply to a valid {op}"
        cursor, fields = resp[0][1][-1]
        reply = decode(fields, EnvReply)
        assert reply.ok and reply.request_id == req.request_id, reply.error
    assert reply.done and reply.reward == 1.0
    await redis.aclose()


async def _weights_announcement_is_read(stack: LocalStack, redis_url: str, run_id: str) -> None:
    """A valid announcement after the bad ones is read, which shows the worker's weights reader still reads. (The
    run has ended, so the worker may already have released its engine: whether it tries a reload is a race.)"""
    name = "rollout_weight_announcements_total"
    before = metric(stack, "rollout-worker", name)
    redis = connect(redis_url)
    await redis.xadd(WEIGHTS, encode(WeightsPublished(run_id=run_id, version=7, uri="http://127.0.0.1:9/none",
                                                      sha256="0" * 64, bytes=1, created_at=time.time())))
    await redis.aclose()
    assert await wait_metric(stack, "rollout-worker", name, before + 1, 30) > before
