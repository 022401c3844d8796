"""Request/reply: `RequestClient` (call, send; replies on its own stream) and `RequestServer` (a group on a
shared stream plus its own inbox)."""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import RedisError as RedisError  # re-exported: services catch it from here

from shared.contracts.messages.codec import Message, MessageDecodeError, decode, encode
from shared.platform.bus.connect import (
    DEFAULT_MAXLEN,
    REDIS_DOWN,
    Delivery,
    _stream_end,
    dead_letter_entry,
    decode_or_skip,
    surviving_data_loss,
)
from shared.platform.bus.publish import StreamBus
from shared.platform.logs import get_logger
from shared.platform.retry import RetryPolicy

log = get_logger(__name__)


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
