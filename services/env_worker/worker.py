"""env-worker loop: serve env requests through the bus's request/reply server (`RequestServer`): resets from
`env.requests` (group "env", shared by all env workers) and this worker's own inbox `env.inbox.<id>`
(step/close of its sticky sessions), read together; handle each request as its own task; write the EnvReply
to `reply_to`, then acknowledge the request. Undecodable requests are dead-lettered; no request kills the loop.
"""

from __future__ import annotations

import asyncio
import time

from services.env_worker.sessions import SessionHost
from services.env_worker.settings import EnvWorkerSettings
from shared.contracts.messages import EnvRequest
from shared.contracts.streams import ENV_REQUESTS, GROUP_ENV, env_inbox
from shared.platform import tracing
from shared.platform.bus import REDIS_DOWN, Delivery, Redis, RequestServer, StreamBus, redis_time
from shared.platform.logs import get_logger
from shared.platform.service import sleep_or_stop

log = get_logger(__name__)


class EnvWorker:
    def __init__(self, cfg: EnvWorkerSettings, worker_id: str, redis: Redis):
        self.cfg, self.worker_id = cfg, worker_id
        self.requests = RequestServer(StreamBus(redis), ENV_REQUESTS, env_inbox(worker_id), GROUP_ENV, worker_id,
                                      EnvRequest, read_count=cfg.read_count, block_ms=cfg.read_block_ms,
                                      reply_maxlen=cfg.reply_maxlen)
        self.host = SessionHost(worker_id, cfg.env_threads, cfg.max_sessions)
        self.inflight: set[asyncio.Task] = set()
        self.status: dict = {}

    async def start(self) -> None:
        await self.requests.start()

    def loops(self, stop: asyncio.Event) -> list:
        return [self.read_loop(stop), self.sweep_loop(stop), self.reclaim_loop(stop)]

    async def read_loop(self, stop: asyncio.Event) -> None:
        await self.start()
        while not stop.is_set():
            for request in await self.requests.read():
                self.spawn(request)
        await self.drain()

    def spawn(self, request: Delivery) -> None:
        task = asyncio.create_task(self.serve_one(request))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    async def serve_one(self, request: Delivery) -> None:
        req: EnvRequest = request.message
        with tracing.span(f"env.serve.{req.op}", req.traceparent, env_worker=self.worker_id, env=req.env,
                          session_id=req.session_id) as span:
            reply = await self.host.handle(req)
            span.set_attributes({"ok": reply.ok, "error_kind": reply.error_kind or ""})
        try:
            await self.requests.reply(request, req.reply_to, reply)
        except (TypeError, ValueError) as e:  # the env returned something msgpack cannot carry
            error = self.host.error_from_reply(reply, f"env returned a value that cannot be sent: {e}")
            await self.requests.reply(request, req.reply_to, error)

    async def sweep_loop(self, stop: asyncio.Event) -> None:
        """Close sessions idle past their TTL (their trajectory ended without a close, or its worker died)."""
        next_trim = time.monotonic() + self.cfg.trim_interval_s
        while not await sleep_or_stop(stop, self.cfg.sweep_interval_s):
            self.host.expire_idle()
            self.status["sessions"] = len(self.host.sessions)
            if time.monotonic() >= next_trim:
                await self.requests.trim()  # bound env.requests and our inbox
                next_trim = time.monotonic() + self.cfg.trim_interval_s

    async def reclaim_loop(self, stop: asyncio.Event) -> None:
        """Resets left pending by a dead env worker: serve those still wanted, drop those given up on."""
        while not await sleep_or_stop(stop, self.cfg.reclaim_interval_s):
            try:
                await self.reclaim_once()
            except REDIS_DOWN:
                continue

    async def reclaim_once(self) -> None:
        requests = await self.requests.reclaim(self.cfg.reclaim_idle_ms)
        now = await redis_time(self.requests.redis) if requests else 0.0
        for request in requests:
            req: EnvRequest = request.message
            if request.age_s(now) > req.timeout_s:  # the rollout worker stopped waiting (ages on Redis's clock)
                await self.requests.drop(request)
            else:
                self.spawn(request)

    async def drain(self) -> None:
        if self.inflight:
            await asyncio.wait(list(self.inflight), timeout=10)

    async def close(self) -> None:
        self.host.shutdown()
