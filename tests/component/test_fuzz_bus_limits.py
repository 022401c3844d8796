"""The codec's entry size limit and the bus helpers for bad entries, against a real Redis: an oversized entry
is refused before it is unpacked, dead-lettered with the size in the reason and counted; readers without a
group skip and count undecodable entries; a client under more concurrent commands than connections waits."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
from prometheus_client import REGISTRY

from shared.contracts.messages import MessageDecodeError, RolloutTask, WeightsPublished, decode, encode
from shared.contracts.messages.codec import DEFAULT_MAX_ENTRY_BYTES, set_max_entry_bytes
from shared.contracts.streams import dead_letter
from shared.platform.bus import StreamBus, StreamConsumer, connect, dead_letter_entry, decode_or_skip


def _task() -> RolloutTask:
    return RolloutTask(run_id="r", task_id="t", sample_idx=0, task={"q": "x" * 100}, dispatched_at=time.time())


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def small_limit():
    set_max_entry_bytes(4096)
    yield 4096
    set_max_entry_bytes(DEFAULT_MAX_ENTRY_BYTES)


def test_oversized_entry_is_refused_with_its_size(small_limit):
    fields = encode(_task())
    fields[b"d"] += b"\x00" * 5000  # garbage after the body: never unpacked
    with pytest.raises(MessageDecodeError, match=r"entry of \d+ bytes exceeds the 4096-byte limit"):
        decode(fields, RolloutTask)
    assert decode(encode(_task()), RolloutTask).task_id == "t"  # a normal entry still decodes


def test_default_limit_admits_large_but_sane_bodies():
    task = _task().model_copy(update={"task": {"blob": "y" * 1_000_000}})
    assert decode(encode(task), RolloutTask).task["blob"] == "y" * 1_000_000
    with pytest.raises(ValueError, match="positive"):
        set_max_entry_bytes(0)


async def test_consumer_dead_letters_oversized_and_keeps_going(redis_client, small_limit):
    bus = StreamBus(redis_client)
    stream, group = "fuzz.limits", "g"
    await bus.ensure_group(stream, group)
    big = encode(_task())
    big[b"d"] = msgpack.packb({"pad": "z" * 10_000})
    await redis_client.xadd(stream, big)
    await bus.publish(stream, _task())
    consumer = StreamConsumer(bus, stream, group, "c", expect=RolloutTask, block_ms=50)
    before = _metric("bus_messages_dead_lettered_total", stream=stream, group=group, cause="undecodable")
    deliveries = await consumer.read()
    assert [d.message.task_id for d in deliveries] == ["t"]
    [(_, dlq)] = await redis_client.xrange(dead_letter(stream))
    assert b"exceeds the 4096-byte limit" in dlq[b"dlq_reason"]
    assert _metric("bus_messages_dead_lettered_total", stream=stream, group=group, cause="undecodable") == before + 1
    assert (await redis_client.xpending(stream, group))["pending"] == 1  # only the good one, not yet acked


async def test_dead_letter_entry_moves_acks_and_counts(redis_client):
    bus = StreamBus(redis_client)
    stream, group = "fuzz.manual", "g"
    await bus.ensure_group(stream, group)
    await redis_client.xadd(stream, {b"junk": b"\xff"})
    [[_, [(eid, fields)]]] = await redis_client.xreadgroup(group, "c", {stream: ">"})
    await dead_letter_entry(redis_client, stream, group, "c", eid, fields, "undecodable: no t/v/d")
    assert (await redis_client.xpending(stream, group))["pending"] == 0
    [(_, dlq)] = await redis_client.xrange(dead_letter(stream))
    assert dlq[b"junk"] == b"\xff" and dlq[b"dlq_reason"] == b"undecodable: no t/v/d" and dlq[b"dlq_id"] == eid
    assert _metric("bus_messages_dead_lettered_total", stream=stream, group=group, cause="undecodable") == 1


def test_decode_or_skip_counts_what_it_skips():
    before = _metric("bus_messages_skipped_total", stream="weights")
    assert decode_or_skip("weights", {b"t": b"weights_published", b"v": b"99", b"d": b""}, WeightsPublished) is None
    assert decode_or_skip("weights", encode(_task()), WeightsPublished) is None
    assert _metric("bus_messages_skipped_total", stream="weights") == before + 2
    ok = WeightsPublished(run_id="r", version=1, uri="u", sha256="s", bytes=0, created_at=0.0)
    assert decode_or_skip("weights", encode(ok), WeightsPublished) == ok


async def test_more_concurrent_commands_than_connections_wait_instead_of_failing(redis_url):
    client = connect(redis_url, max_connections=4)
    try:  # 200 at once through 4 connections: each waits its turn (redis-py's default pool would raise)
        replies = await asyncio.gather(*(client.xadd("fuzz.pool", {b"i": str(i).encode()}) for i in range(200)))
        assert len(set(replies)) == 200 and await client.xlen("fuzz.pool") == 200
        assert client.connection_pool.max_connections == 4
    finally:
        await client.delete("fuzz.pool")
        await client.aclose()
