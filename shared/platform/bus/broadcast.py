"""Broadcast: `announce` (sync) appends like `StreamBus.publish`; `BroadcastReader` reads with its own cursor,
no group, nothing acknowledged."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis import Redis as SyncRedis
from redis.exceptions import RedisError as RedisError  # re-exported: services catch it from here

from shared.contracts.messages.codec import Message, encode
from shared.platform.bus.connect import (
    DEFAULT_MAXLEN,
    MESSAGES_PUBLISHED,
    REDIS_DOWN,
    _stream_end,
    decode_or_skip,
)


def announce(redis: SyncRedis, stream: str, msg: Message, *, maxlen: int = DEFAULT_MAXLEN) -> bytes:
    """Broadcast from synchronous code (the weight server): the same append as `StreamBus.publish`."""
    entry_id = redis.xadd(stream, encode(msg), maxlen=maxlen, approximate=True)
    MESSAGES_PUBLISHED.labels(stream).inc()
    return entry_id


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
