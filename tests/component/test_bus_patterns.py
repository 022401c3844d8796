"""The delivery guarantee each pattern of shared/platform/bus.py states, against a real Redis: the work queue's hold and
take-over (test_bus.py covers its at-least-once core), request/reply, broadcast, and read-only inspection."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from shared.contracts.messages import EnvReply, EnvRequest, RolloutTask, WeightsPublished, encode
from shared.contracts.streams import dead_letter
from shared.platform.bus import (
    BroadcastReader,
    RequestClient,
    RequestServer,
    StreamBus,
    StreamConsumer,
    announce,
    connect,
    stream_stats,
)

QUEUE, GROUP = "test.queue", "workers"
SHARED, INBOX_A, INBOX_B, REPLIES = "test.requests", "test.inbox.a", "test.inbox.b", "test.replies.c"
BROADCAST = "test.weights"


def _task(i: int, run_id: str = "r1") -> RolloutTask:
    return RolloutTask(run_id=run_id, task_id=f"t{i}", sample_idx=0, task={"i": i}, dispatched_at=time.time())


def _request(op: str = "reset", reply_to: str = REPLIES, timeout_s: float = 30.0) -> EnvRequest:
    return EnvRequest(request_id=uuid.uuid4().hex, op=op, session_id="s1", run_id="r1", env="math",
                      reply_to=reply_to, timeout_s=timeout_s, sent_at=time.time())


def _reply(req: EnvRequest, worker: str = "a") -> EnvReply:
    return EnvReply(request_id=req.request_id, session_id=req.session_id, env_worker_id=worker, ok=True,
                    observation=f"served by {worker}")


def _weights(v: int) -> WeightsPublished:
    return WeightsPublished(run_id="r1", version=v, uri=f"http://w/{v}", sha256="0" * 64, bytes=1,
                            created_at=time.time())


async def _pending(r, stream: str, group: str) -> dict[str, int]:
    """consumer name -> entries it holds."""
    return {c["name"].decode(): c["pending"] for c in await r.xinfo_consumers(stream, group)}


# -- work queue -------------------------------------------------------------------------------------------------
async def test_work_queue_keep_alive_holds_entries_past_claim_idle(redis_client):
    """A consumer still working on an entry keeps it (keep_alive); one that stopped calling it loses it to a
    peer once idle for claim_idle_ms."""
    bus = StreamBus(redis_client)
    await bus.publish_many(QUEUE, [_task(0), _task(1)])
    a = StreamConsumer(bus, QUEUE, GROUP, "a", expect=RolloutTask, claim_idle_ms=300, block_ms=10)
    b = StreamConsumer(bus, QUEUE, GROUP, "b", expect=RolloutTask, claim_idle_ms=300, block_ms=10)
    await a.start()
    held = await a.read()
    assert [d.message.task_id for d in held] == ["t0", "t1"]
    for _ in range(6):  # 0.6 s, twice the idle limit: t0 is kept alive, t1 is not
        await asyncio.sleep(0.1)
        await a.keep_alive([held[0]])
    taken = await b.read()
    assert [d.message.task_id for d in taken] == ["t1"]
    assert await _pending(redis_client, QUEUE, GROUP) == {"a": 1, "b": 1}


async def test_work_queue_without_claim_idle_never_takes_a_peers_entries_by_timer(redis_client):
    bus = StreamBus(redis_client)
    await bus.publish(QUEUE, _task(0))
    a = StreamConsumer(bus, QUEUE, GROUP, "a", expect=RolloutTask, claim_idle_ms=None, block_ms=10)
    b = StreamConsumer(bus, QUEUE, GROUP, "b", expect=RolloutTask, claim_idle_ms=None, block_ms=10)
    await a.start()
    assert len(await a.read()) == 1
    await asyncio.sleep(0.2)
    assert await b.read() == []
    assert (await _pending(redis_client, QUEUE, GROUP)).get("b", 0) == 0


async def test_work_queue_take_over_pending_claims_every_held_entry(redis_client):
    """take_over_pending claims what any consumer holds, however briefly, page by page; undecodable entries
    are dead-lettered, never handed out."""
    bus = StreamBus(redis_client)
    await bus.publish_many(QUEUE, [_task(i) for i in range(5)])
    await redis_client.xadd(QUEUE, {b"junk": b"1"})
    dead = StreamConsumer(bus, QUEUE, GROUP, "dead", expect=RolloutTask, claim_idle_ms=None, block_ms=10)
    await dead.start()
    await redis_client.xreadgroup(GROUP, "dead", {QUEUE: ">"})  # read, never acked: a consumer that died
    heir = StreamConsumer(bus, QUEUE, GROUP, "heir", expect=RolloutTask, claim_idle_ms=None, batch_size=2)
    pages = [page async for page in heir.take_over_pending()]
    assert sorted(d.message.task_id for page in pages for d in page) == [f"t{i}" for i in range(5)]
    assert len(pages) >= 3  # batch_size 2: several pages
    assert await _pending(redis_client, QUEUE, GROUP) == {"dead": 0, "heir": 5}
    assert await redis_client.xlen(dead_letter(QUEUE)) == 1


async def test_work_queue_without_max_deliveries_never_dead_letters(redis_client):
    bus = StreamBus(redis_client)
    await bus.publish(QUEUE, _task(0))
    c = StreamConsumer(bus, QUEUE, GROUP, "c", expect=RolloutTask, max_deliveries=None, retry_delay_s=0.001,
                       block_ms=10)
    await c.start()
    tries = 0

    async def fails(batch):
        nonlocal tries
        tries += 1
        raise RuntimeError("bad")

    while tries < 12:
        await c.process(fails, await c.read())
    assert await redis_client.xlen(dead_letter(QUEUE)) == 0
    assert (await redis_client.xpending(QUEUE, GROUP))["pending"] == 1


async def test_work_queue_read_without_block_returns_at_once(redis_client):
    c = StreamConsumer(StreamBus(redis_client), QUEUE, GROUP, "c", expect=RolloutTask, block_ms=None)
    await c.start()
    start = time.monotonic()
    assert await c.read() == []
    assert time.monotonic() - start < 0.5


async def test_withdraw_unread_takes_back_only_entries_nobody_read(redis_client):
    bus = StreamBus(redis_client)
    assert await bus.withdraw_unread(QUEUE, GROUP, RolloutTask, lambda t: True) == []  # no stream yet
    await bus.publish_many(QUEUE, [_task(0, "r1"), _task(1, "r2"), _task(2, "r1"), _task(3, "r1")])
    c = StreamConsumer(bus, QUEUE, GROUP, "c", expect=RolloutTask, batch_size=1, block_ms=10)
    await c.start()
    [first] = await c.read()  # t0 is delivered: it stays
    assert first.message.task_id == "t0"
    withdrawn = await bus.withdraw_unread(QUEUE, GROUP, RolloutTask, lambda t: t.run_id == "r1")
    assert [t.task_id for t in withdrawn] == ["t2", "t3"]
    c.batch_size = 10
    assert [d.message.task_id for d in await c.read()] == ["t1"]  # the other run's task is still queued
    assert await redis_client.xlen(QUEUE) == 2


# -- request/reply ----------------------------------------------------------------------------------------------
async def _serve(server: RequestServer, stop: asyncio.Event, worker: str = "a", replies: int = 1) -> None:
    while not stop.is_set():
        for d in await server.read():
            for _ in range(replies):
                await server.reply(d, d.message.reply_to, _reply(d.message, worker))


@pytest.fixture
async def requests_side(redis_client):
    bus = StreamBus(redis_client)
    client = RequestClient(bus, REPLIES, EnvReply, sweep_ms=20)
    server = RequestServer(bus, SHARED, INBOX_A, "env", "a", EnvRequest, block_ms=20)
    await server.start()
    await client.start()
    stop = asyncio.Event()
    reader = asyncio.create_task(client.run(stop))
    yield bus, client, server, stop
    stop.set()
    await reader


async def test_request_reply_returns_the_reply_and_acks_after_it(requests_side, redis_client):
    bus, client, server, stop = requests_side
    serving = asyncio.create_task(_serve(server, stop, replies=2))  # a duplicate reply is discarded
    req = _request()
    reply = await client.call(SHARED, req, wait_s=5)
    assert reply.request_id == req.request_id and reply.observation == "served by a"
    step = _request("step")
    assert (await client.call(INBOX_A, step, wait_s=5)).request_id == step.request_id
    for _ in range(50):  # the ack follows the reply
        if sum([(await redis_client.xpending(s, "env"))["pending"] for s in (SHARED, INBOX_A)]) == 0:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("requests still pending after their replies")
    assert client.waiters == {}
    stop.set()
    await serving


async def test_request_is_not_acknowledged_when_its_reply_cannot_be_written(requests_side, redis_client):
    bus, client, server, stop = requests_side
    await redis_client.set("not-a-stream", "x")
    await client.send(SHARED, _request(reply_to="not-a-stream"))
    [d] = await server.read()
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        await server.reply(d, "not-a-stream", _reply(d.message))
    assert (await redis_client.xpending(SHARED, "env"))["pending"] == 1  # still held: nothing was lost


async def test_request_without_server_times_out_and_late_reply_is_discarded(requests_side, redis_client):
    bus, client, server, stop = requests_side
    req = _request()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        await client.call(SHARED, req, wait_s=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0  # never hangs; overruns by at most a sweep or so
    [request] = await server.read()  # served late
    await server.reply(request, REPLIES, _reply(req))
    await asyncio.sleep(0.1)
    assert client.waiters == {}  # nobody is resolved by it, nothing leaks


async def test_reply_stream_of_a_previous_incarnation_is_ignored(redis_client):
    bus = StreamBus(redis_client)
    old = _request()
    await redis_client.xadd(REPLIES, encode(_reply(old)))  # a reply to the client's previous life
    client = RequestClient(bus, REPLIES, EnvReply, sweep_ms=20)
    await client.start()
    stop = asyncio.Event()
    reader = asyncio.create_task(client.run(stop))
    with pytest.raises(TimeoutError):
        await client.call("nowhere", old, wait_s=0.2)  # same request id: the old reply must not answer it
    stop.set()
    await reader


async def test_request_server_dead_letters_undecodable_and_drops_given_up(requests_side, redis_client):
    bus, client, server, stop = requests_side
    await redis_client.xadd(INBOX_A, {b"junk": b"1"})
    assert await server.read() == []
    assert await redis_client.xlen(dead_letter(INBOX_A)) == 1
    assert (await redis_client.xpending(INBOX_A, "env"))["pending"] == 0
    await client.send(SHARED, _request(reply_to=""))
    [d] = await server.read()
    await server.drop(d)
    assert (await redis_client.xpending(SHARED, "env"))["pending"] == 0
    assert await redis_client.xlen(REPLIES) == 0


async def test_shared_requests_of_a_dead_server_are_reclaimed_inbox_ones_are_not(requests_side, redis_client):
    bus, client, server, stop = requests_side  # server "a" reads and dies without replying
    other = RequestServer(bus, SHARED, INBOX_B, "env", "b", EnvRequest, block_ms=20)
    await other.start()
    reset, step = _request("reset"), _request("step")
    await client.send(SHARED, reset)
    await client.send(INBOX_A, step)
    assert {d.message.request_id for d in await server.read()} == {reset.request_id, step.request_id}
    assert await other.reclaim(idle_ms=60_000) == []  # not idle long enough: a live server may be working
    await asyncio.sleep(0.15)
    reclaimed = await other.reclaim(idle_ms=100)
    assert [d.message.request_id for d in reclaimed] == [reset.request_id]  # never a's inbox
    await other.reply(reclaimed[0], REPLIES, _reply(reset, "b"))
    assert await _pending(redis_client, SHARED, "env") == {"a": 0, "b": 0}
    assert (await redis_client.xpending(INBOX_A, "env"))["pending"] == 1


async def test_shared_requests_sent_before_any_server_are_not_served(redis_client):
    bus = StreamBus(redis_client)
    await redis_client.xadd(SHARED, encode(_request()))  # its caller gave up long ago
    server = RequestServer(bus, SHARED, INBOX_A, "env", "a", EnvRequest, block_ms=20)
    await server.start()
    assert await server.read() == []


async def test_request_server_survives_unreachable_redis():
    dead = connect("redis://127.0.0.1:1/0")
    server = RequestServer(StreamBus(dead), SHARED, INBOX_A, "env", "a", EnvRequest, block_ms=20)
    assert await server.read() == []
    await dead.aclose()


# -- broadcast --------------------------------------------------------------------------------------------------
async def test_broadcast_every_reader_sees_every_later_entry_once_in_order(redis_client, redis_url):
    sync = redis.Redis.from_url(redis_url)
    announce(sync, BROADCAST, _weights(0))  # before the readers started: not theirs
    readers = [BroadcastReader(redis_client, BROADCAST, WeightsPublished, count=2, block_ms=10) for _ in range(2)]
    for r in readers:
        await r.start()
    bus = StreamBus(redis_client)
    for v in range(1, 4):
        await bus.publish(BROADCAST, _weights(v))
    await redis_client.xadd(BROADCAST, {b"junk": b"1"})  # skipped and counted, nothing else lost
    announce(sync, BROADCAST, _weights(4))
    for r in readers:
        seen = []
        for _ in range(5):
            seen += [m.version for m in await r.read()]
        assert seen == [1, 2, 3, 4]
        assert await r.read() == []  # once


async def test_broadcast_reader_on_a_new_stream_and_through_an_outage(redis_client):
    reader = BroadcastReader(redis_client, BROADCAST, WeightsPublished, block_ms=10)
    await reader.start()  # no stream yet: starts at its beginning
    await StreamBus(redis_client).publish(BROADCAST, _weights(1))
    assert [m.version for m in await reader.read()] == [1]
    dead = connect("redis://127.0.0.1:1/0")
    offline = BroadcastReader(dead, BROADCAST, WeightsPublished, block_ms=10)
    offline.cursor = reader.cursor
    assert await offline.read() == [] and offline.cursor == reader.cursor  # cursor kept
    await dead.aclose()


# -- inspection -------------------------------------------------------------------------------------------------
async def test_stream_stats_reports_length_pending_lag_and_dead_letters(redis_client, redis_url):
    sync = redis.Redis.from_url(redis_url)
    empty = stream_stats(sync, QUEUE)
    assert (empty.length, empty.dead_letters, empty.groups) == (0, 0, [])
    bus = StreamBus(redis_client)
    await bus.publish_many(QUEUE, [_task(i) for i in range(5)])
    c = StreamConsumer(bus, QUEUE, GROUP, "c", expect=RolloutTask, batch_size=2, block_ms=10)
    await c.start()
    await c.read()  # 2 delivered, 3 not yet
    await redis_client.xadd(dead_letter(QUEUE), {b"x": b"1"})
    stats = stream_stats(sync, QUEUE)
    assert (stats.length, stats.dead_letters) == (5, 1)
    assert [(g.name, g.pending, g.lag) for g in stats.groups] == [(GROUP, 2, 3)]
    assert await redis_client.xlen(QUEUE) == 5  # read-only
