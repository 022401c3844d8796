"""The producer side of a work queue and of a command's answer: `StreamBus` (publish, answer, groups, trimming)
over a `CommandBatcher` that pipelines what many coroutines send at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError as RedisError  # re-exported: services catch it from here
from redis.exceptions import ResponseError

from shared.contracts.messages.codec import Message, MessageDecodeError, decode, encode
from shared.platform.bus.connect import (
    ANSWER_TTL_S,
    DEFAULT_MAXLEN,
    MESSAGES_PUBLISHED,
    M,
    _next_id,
    parse_stream_id,
)


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
            need = _next_id(parse_stream_id(g["last-delivered-id"]))
            if g["pending"]:
                summary = await self.redis.xpending(stream, g["name"])
                if summary["min"] is not None:  # None: the pending entries were acked since XINFO
                    need = min(need, parse_stream_id(summary["min"]))
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
