"""env-worker loop: read `env.requests` (first reset, group "env", shared by all env workers) and this
worker's own inbox `env.inbox.<id>` (step/close of its sticky sessions) in one blocking XREADGROUP; handle
each request as its own task; write the EnvReply to `reply_to`, then XACK the request (the replies and acks
of concurrent requests share pipelined round trips: `CommandBatcher`). Undecodable requests are
dead-lettered; no request kills the loop.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from services.env_worker.config import EnvWorkerConfig
from services.env_worker.sessions import SessionHost
from shared.bus import REDIS_DOWN, StreamBus, dead_letter_entry
from shared.logs import get_logger
from shared.messages import EnvReply, EnvRequest, MessageDecodeError, decode, encode
from shared.service import sleep_or_stop
from shared.streams import ENV_REQUESTS, GROUP_ENV, env_inbox

log = get_logger(__name__)
SEND_ATTEMPTS = 8


class EnvWorker:
    def __init__(self, cfg: EnvWorkerConfig, worker_id: str, redis: aioredis.Redis):
        self.cfg, self.worker_id, self.redis = cfg, worker_id, redis
        self.bus = StreamBus(redis)
        self.inbox = env_inbox(worker_id)
        self.host = SessionHost(worker_id, cfg.env_threads, cfg.max_sessions)
        self.inflight: set[asyncio.Task] = set()
        self.status: dict = {}

    async def start(self) -> None:
        await self.bus.ensure_group(ENV_REQUESTS, GROUP_ENV, start_id="$")  # old resets have been given up on
        await self.bus.ensure_group(self.inbox, GROUP_ENV, start_id="0")

    def loops(self, stop: asyncio.Event) -> list:
        return [self.read_loop(stop), self.sweep_loop(stop), self.reclaim_loop(stop)]

    async def read_loop(self, stop: asyncio.Event) -> None:
        await self.start()
        streams = {ENV_REQUESTS: ">", self.inbox: ">"}
        while not stop.is_set():
            try:
                resp = await self.redis.xreadgroup(GROUP_ENV, self.worker_id, streams, count=self.cfg.read_count,
                                                   block=self.cfg.read_block_ms)
            except REDIS_DOWN:
                await asyncio.sleep(0.5)
                continue
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                await self.start()
                continue
            for stream, entries in resp or []:
                for entry_id, fields in entries:
                    self.spawn(stream.decode(), entry_id, fields)
        await self.drain()

    def spawn(self, stream: str, entry_id: bytes, fields: dict) -> None:
        task = asyncio.create_task(self.serve_one(stream, entry_id, fields))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    async def serve_one(self, stream: str, entry_id: bytes, fields: dict) -> None:
        try:
            req = decode(fields, EnvRequest)
        except MessageDecodeError as e:
            await self.dead_letter(stream, entry_id, fields, str(e))
            return
        reply = await self.host.handle(req)
        await self.send(stream, entry_id, req.reply_to, reply)

    async def send(self, stream: str, entry_id: bytes, reply_to: str, reply: EnvReply) -> None:
        try:
            body = encode(reply)
        except (TypeError, ValueError) as e:  # the env returned something msgpack cannot carry
            reply = self.host.error_from_reply(reply, f"env returned a value that cannot be sent: {e}")
            body = encode(reply)
        batcher = self.bus.batcher  # replies of concurrent requests share round trips
        for attempt in range(SEND_ATTEMPTS):  # a lost reply costs the rollout worker a timeout and a retry
            try:
                if reply_to:  # empty: the caller wants no reply (fire-and-forget close)
                    await batcher.call("xadd", reply_to, body, maxlen=self.cfg.reply_maxlen, approximate=True)
                await batcher.call("xack", stream, GROUP_ENV, entry_id)
                return
            except REDIS_DOWN as e:
                log.warning("reply to %s failed (attempt %d): %r", reply_to, attempt + 1, e)
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))

    async def dead_letter(self, stream: str, entry_id: bytes, fields: dict, reason: str) -> None:
        log.warning("undecodable env request %s on %s: %s", entry_id, stream, reason)
        await dead_letter_entry(self.redis, stream, GROUP_ENV, self.worker_id, entry_id, fields, reason)

    async def sweep_loop(self, stop: asyncio.Event) -> None:
        """Close sessions idle past their TTL (their trajectory ended without a close, or its worker died)."""
        next_trim = time.monotonic() + self.cfg.trim_interval_s
        while not await sleep_or_stop(stop, self.cfg.sweep_interval_s):
            self.host.expire_idle()
            self.status["sessions"] = len(self.host.sessions)
            if time.monotonic() >= next_trim:
                await self.trim()
                next_trim = time.monotonic() + self.cfg.trim_interval_s

    async def trim(self) -> None:
        """Bound env.requests and this worker's inbox: drop what every group has acknowledged."""
        for stream in (ENV_REQUESTS, self.inbox):
            try:
                await self.bus.trim_acknowledged(stream)
            except REDIS_DOWN as e:
                log.warning("trim of %s failed: %r", stream, e)

    async def reclaim_loop(self, stop: asyncio.Event) -> None:
        """Resets left pending by a dead env worker: serve those still wanted, drop those given up on."""
        while not await sleep_or_stop(stop, self.cfg.reclaim_interval_s):
            try:
                await self.reclaim_once()
            except REDIS_DOWN:
                continue

    async def reclaim_once(self) -> None:
        resp = await self.redis.xautoclaim(ENV_REQUESTS, GROUP_ENV, self.worker_id, self.cfg.reclaim_idle_ms,
                                           start_id="0-0", count=self.cfg.read_count)
        for entry_id, fields in resp[1]:
            if fields is None:
                continue
            try:
                req = decode(fields, EnvRequest)
            except MessageDecodeError as e:
                await self.dead_letter(ENV_REQUESTS, entry_id, fields, str(e))
                continue
            if time.time() - req.sent_at > req.timeout_s:  # the rollout worker stopped waiting
                await self.redis.xack(ENV_REQUESTS, GROUP_ENV, entry_id)
                continue
            self.spawn(ENV_REQUESTS, entry_id, fields)

    async def drain(self) -> None:
        if self.inflight:
            await asyncio.wait(list(self.inflight), timeout=10)

    async def close(self) -> None:
        self.host.shutdown()

