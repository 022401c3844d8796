"""Env sessions through env workers: resets go to `env.requests` (any env worker), later calls to the
owning worker's inbox; replies come back on this rollout worker's own stream `env.replies.<id>`, read by one
background reader that resolves the waiting futures. No reply in time means the env worker is gone:
`EnvSessionLost`, an infrastructure failure. A step that ends the episode also closes the session on the env
worker (`EnvReply.closed`); other endings send a close that wants no reply."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Histogram

from shared.bus import REDIS_DOWN, StreamBus, decode_or_skip
from shared.logs import get_logger
from shared.messages import EnvReply, EnvRequest, encode
from shared.streams import ENV_REQUESTS, env_inbox, env_replies

log = get_logger(__name__)
ENV_RTT = Histogram("rollout_env_rtt_seconds", "Env request round trip through Redis", ["op"],
                    buckets=(2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.02, 0.1, 0.5, 2, 10, 60))
REQUEST_MAXLEN = 1_000_000
SWEEP_MS = 100  # reply reads block at most this long, so waiter deadlines are checked this often


class EnvSessionLost(Exception):
    """The env worker holding the session did not answer (dead, or the session expired)."""


class EnvClient:
    def __init__(self, bus: StreamBus, worker_id: str, reply_margin_s: float):
        self.redis = bus.redis
        self.batcher = bus.batcher  # requests share round trips with each other and the worker's publishes/acks
        self.reply_stream = env_replies(worker_id)
        self.margin_s = reply_margin_s
        self.waiters: dict[str, tuple[asyncio.Future, float]] = {}  # request id -> (future, deadline)
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
            self.expire_waiters()
            try:
                resp = await self.redis.xread({self.reply_stream: self.cursor}, count=512, block=SWEEP_MS)
            except REDIS_DOWN:
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

    def expire_waiters(self) -> None:
        """Deadlines are swept here, a few times a second, instead of a timer per call (timer handles were a
        visible share of the worker's CPU at hundreds of calls per second)."""
        now = time.monotonic()
        for future, deadline in list(self.waiters.values()):
            if now > deadline and not future.done():
                future.set_exception(TimeoutError())

    def resolve(self, fields: dict) -> None:
        reply = decode_or_skip(self.reply_stream, fields, EnvReply)
        if reply is None:
            return
        waiter = self.waiters.pop(reply.request_id, None)
        if waiter is not None and not waiter[0].done():
            waiter[0].set_result(reply)

    def request(self, op: str, session_id: str, *, run_id: str, env: str, env_args: dict | None = None,
                task: dict | None = None, action: Any = None, timeout_s: float = 30.0, ttl_s: float = 900.0,
                reply: bool = True) -> EnvRequest:
        return EnvRequest(request_id=uuid.uuid4().hex, op=op, session_id=session_id, run_id=run_id, env=env,
                          env_args=env_args or {}, task=task, action=action,
                          reply_to=self.reply_stream if reply else "", timeout_s=timeout_s, session_ttl_s=ttl_s,
                          sent_at=time.time())

    async def call(self, op: str, session_id: str, *, owner: str | None = None, **kwargs: Any) -> EnvReply:
        req = self.request(op, session_id, **kwargs)
        wait_s = req.timeout_s + self.margin_s
        future = asyncio.get_running_loop().create_future()
        self.waiters[req.request_id] = (future, time.monotonic() + wait_s)
        start = time.perf_counter()
        try:
            await self._send(req, owner)
            return await future
        except TimeoutError as e:
            raise EnvSessionLost(f"no reply to env {op} of session {session_id} within "
                                 f"{wait_s:.0f}s (env worker {owner or 'any'})") from e
        except REDIS_DOWN as e:
            raise EnvSessionLost(f"env {op} of session {session_id} could not be sent: {e!r}") from e
        finally:
            self.waiters.pop(req.request_id, None)
            ENV_RTT.labels(op).observe(time.perf_counter() - start)

    def _send(self, req: EnvRequest, owner: str | None) -> asyncio.Future:
        stream = ENV_REQUESTS if req.op == "reset" else env_inbox(owner)
        return self.batcher.call("xadd", stream, encode(req), maxlen=REQUEST_MAXLEN, approximate=True)

    def close_quietly(self, session_id: str, *, owner: str, **kwargs: Any) -> None:
        """Fire-and-forget close without a reply (the session expires on its own if this is lost)."""
        sent = self._send(self.request("close", session_id, timeout_s=5.0, reply=False, **kwargs), owner)
        sent.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
