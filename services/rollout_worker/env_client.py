"""Env sessions through env workers: resets go to `env.requests` (any env worker), later calls to the
owning worker's inbox; replies come back on this rollout worker's own stream `env.replies.<id>`, read by one
background reader that resolves the waiting futures. No reply in time means the env worker is gone:
`EnvSessionLost`, an infrastructure failure."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Histogram

from shared.bus import decode_or_skip
from shared.logs import get_logger
from shared.messages import EnvReply, EnvRequest, encode
from shared.streams import ENV_REQUESTS, env_inbox, env_replies

log = get_logger(__name__)
ENV_RTT = Histogram("rollout_env_rtt_seconds", "Env request round trip through Redis", ["op"],
                    buckets=(2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.02, 0.1, 0.5, 2, 10, 60))
REQUEST_MAXLEN = 1_000_000


class EnvSessionLost(Exception):
    """The env worker holding the session did not answer (dead, or the session expired)."""


class EnvClient:
    def __init__(self, redis: aioredis.Redis, worker_id: str, reply_margin_s: float):
        self.redis = redis
        self.reply_stream = env_replies(worker_id)
        self.margin_s = reply_margin_s
        self.waiters: dict[str, asyncio.Future] = {}
        self.cursor = "0-0"

    async def start(self) -> None:
        """Read replies from the current end of our stream (older ones belong to a previous incarnation)."""
        try:
            info = await self.redis.xinfo_stream(self.reply_stream)
            self.cursor = info["last-generated-id"]
        except aioredis.ResponseError:
            self.cursor = "0-0"

    async def reader(self, stop: asyncio.Event) -> None:
        read = 0
        while not stop.is_set():
            try:
                resp = await self.redis.xread({self.reply_stream: self.cursor}, count=512, block=200)
            except (ConnectionError, OSError, aioredis.ConnectionError, aioredis.TimeoutError):
                await asyncio.sleep(0.5)
                continue
            for _, entries in resp or []:
                for entry_id, fields in entries:
                    self.cursor = entry_id
                    self.resolve(fields)
                read += len(entries)
            if read >= 1000:  # we are this stream's only reader: drop what we have read
                await self.redis.xtrim(self.reply_stream, minid=self.cursor, approximate=True)
                read = 0

    def resolve(self, fields: dict) -> None:
        reply = decode_or_skip(self.reply_stream, fields, EnvReply)
        if reply is None:
            return
        future = self.waiters.pop(reply.request_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    async def call(self, op: str, session_id: str, *, run_id: str, env: str, owner: str | None = None,
                   env_args: dict | None = None, task: dict | None = None, action: Any = None,
                   timeout_s: float = 30.0, ttl_s: float = 900.0) -> EnvReply:
        req = EnvRequest(request_id=uuid.uuid4().hex, op=op, session_id=session_id, run_id=run_id, env=env,
                         env_args=env_args or {}, task=task, action=action, reply_to=self.reply_stream,
                         timeout_s=timeout_s, session_ttl_s=ttl_s, sent_at=time.time())
        stream = ENV_REQUESTS if op == "reset" else env_inbox(owner)
        future = asyncio.get_running_loop().create_future()
        self.waiters[req.request_id] = future
        start = time.perf_counter()
        try:
            await self.redis.xadd(stream, encode(req), maxlen=REQUEST_MAXLEN, approximate=True)
            async with asyncio.timeout(timeout_s + self.margin_s):
                return await future
        except TimeoutError as e:
            raise EnvSessionLost(f"no reply to env {op} of session {session_id} within "
                                 f"{timeout_s + self.margin_s:.0f}s (env worker {owner or 'any'})") from e
        finally:
            self.waiters.pop(req.request_id, None)
            ENV_RTT.labels(op).observe(time.perf_counter() - start)

    def close_quietly(self, session_id: str, **kwargs: Any) -> None:
        """Fire-and-forget close (the session expires on its own if this is lost)."""
        task = asyncio.create_task(self.call("close", session_id, timeout_s=5.0, **kwargs))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
