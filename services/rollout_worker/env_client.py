"""Env sessions through env workers, over the bus's request/reply client (`RequestClient`): resets go to
`env.requests` (any env worker), later calls to the owning worker's inbox; replies come back on this rollout
worker's own stream `env.replies.<id>`. No reply in time means the env worker is gone: `EnvSessionLost`, an
infrastructure failure. A step that ends the episode also closes the session on the env worker
(`EnvReply.closed`); other endings send a close that wants no reply."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from prometheus_client import Histogram

from shared.contracts.messages import EnvReply, EnvRequest
from shared.contracts.streams import ENV_REQUESTS, env_inbox, env_replies
from shared.platform import tracing
from shared.platform.bus import REDIS_DOWN, RequestClient, StreamBus
from shared.platform.logs import get_logger

log = get_logger(__name__)
ENV_RTT = Histogram("rollout_env_rtt_seconds", "Env request round trip through Redis", ["op"],
                    buckets=(2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.02, 0.1, 0.5, 2, 10, 60))
SWEEP_MS = 100  # reply reads block at most this long, so waiter deadlines are checked this often


class EnvSessionLost(Exception):
    """The env worker holding the session did not answer (dead, or the session expired)."""


class EnvClient:
    def __init__(self, bus: StreamBus, worker_id: str, reply_margin_s: float):
        self.client = RequestClient(bus, env_replies(worker_id), EnvReply, sweep_ms=SWEEP_MS)
        self.margin_s = reply_margin_s

    async def start(self) -> None:
        await self.client.start()

    async def reader(self, stop: asyncio.Event) -> None:
        await self.client.run(stop)

    def request(self, op: str, session_id: str, *, run_id: str, env: str, env_args: dict | None = None,
                task: dict | None = None, action: Any = None, timeout_s: float = 30.0, ttl_s: float = 900.0,
                reply: bool = True) -> EnvRequest:
        return EnvRequest(request_id=uuid.uuid4().hex, op=op, session_id=session_id, run_id=run_id, env=env,
                          env_args=env_args or {}, task=task, action=action,
                          reply_to=self.client.reply_stream if reply else "", timeout_s=timeout_s,
                          session_ttl_s=ttl_s, sent_at=time.time(), traceparent=tracing.traceparent())

    async def call(self, op: str, session_id: str, *, owner: str | None = None, **kwargs: Any) -> EnvReply:
        req = self.request(op, session_id, **kwargs)
        wait_s = req.timeout_s + self.margin_s
        start = time.perf_counter()
        try:
            with tracing.span(f"env.{op}", session_id=session_id, env_worker=owner) as span:
                req.traceparent = tracing.traceparent()  # the env worker's span is this one's child
                reply = await self.client.call(self._stream(req, owner), req, wait_s)
                span.set_attributes({"ok": reply.ok, "reward": reply.reward, "done": reply.done})
                return reply
        except TimeoutError as e:
            raise EnvSessionLost(f"no reply to env {op} of session {session_id} within "
                                 f"{wait_s:.0f}s (env worker {owner or 'any'})") from e
        except REDIS_DOWN as e:
            raise EnvSessionLost(f"env {op} of session {session_id} could not be sent: {e!r}") from e
        finally:
            ENV_RTT.labels(op).observe(time.perf_counter() - start)

    @staticmethod
    def _stream(req: EnvRequest, owner: str | None) -> str:
        return ENV_REQUESTS if req.op == "reset" else env_inbox(owner)

    def close_quietly(self, session_id: str, *, owner: str, **kwargs: Any) -> None:
        """Fire-and-forget close without a reply (the session expires on its own if this is lost)."""
        req = self.request("close", session_id, timeout_s=5.0, reply=False, **kwargs)
        sent = self.client.send(self._stream(req, owner), req)
        sent.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
