"""Env sessions: one env instance per trajectory, called off the event loop with a per-call time limit.

Errors are values, not exceptions: every call returns an `EnvReply`, ok or with an `error_kind`:
`user` (the env raised; traceback attached), `timeout` (the call overran; the session is dropped because
its thread may still be inside the env), `session_lost` (unknown session: expired, or another worker's),
`bad_request` (the env name does not resolve), `infra` (the env's sandbox failed: a container died or hung, or
the sandbox the env asks for cannot run on this worker, e.g. its image is not on the engine).
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.env_worker.sandbox.ns import SandboxInfraError, SandboxUnavailable
from shared.contracts.messages import EnvReply, EnvRequest
from shared.contracts.registry import resolve
from shared.platform.logs import get_logger

log = get_logger(__name__)
REQUESTS = Counter("env_requests_total", "Env requests handled", ["op", "outcome"])
CALL_SECONDS = Histogram("env_call_seconds", "Time inside env methods", ["op"],
                         buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.02, 0.1, 0.5, 2, 10, 60))
SESSIONS = Gauge("env_sessions_active", "Env sessions hosted")
EXPIRED = Counter("env_sessions_expired_total", "Sessions closed after idling past their TTL")


class CallTimeout(Exception):
    pass


@dataclass
class Session:
    env: Any
    run_id: str
    env_name: str
    ttl_s: float
    last_used: float = field(default_factory=time.monotonic)


class SessionHost:
    def __init__(self, worker_id: str, threads: int, max_sessions: int):
        self.worker_id = worker_id
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="env")
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}
        self._classes: dict[str, Any] = {}

    async def handle(self, req: EnvRequest) -> EnvReply:
        start = time.perf_counter()
        handler = {"reset": self.reset, "step": self.step, "close": self.close}[req.op]
        try:
            reply = await handler(req)
        except CallTimeout:
            self.drop(req.session_id)
            reply = self.error(req, "timeout", f"env {req.op} exceeded {req.timeout_s}s")
        except SandboxInfraError as e:  # the env's container died or hung: not the env's nor the policy's doing
            self.drop(req.session_id)
            reply = self.error(req, "infra", f"sandbox failure: {e}")
        except SandboxUnavailable as e:  # the worker lacks what the env's sandbox needs: the fleet's fault, never scored
            self.drop(req.session_id)
            reply = self.error(req, "infra", f"sandbox unavailable on {self.worker_id}: {e}")
        except Exception:
            self.drop(req.session_id)
            reply = self.error(req, "user", traceback.format_exc(limit=20)[-8000:])
        reply.elapsed_ms = (time.perf_counter() - start) * 1000
        REQUESTS.labels(req.op, reply.error_kind or "ok").inc()
        return reply

    async def call(self, req: EnvRequest, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        future = asyncio.get_running_loop().run_in_executor(self.pool, fn)
        try:
            async with asyncio.timeout(req.timeout_s):  # cheaper than wait_for: no extra task per call
                return await future
        except TimeoutError as e:
            raise CallTimeout() from e
        finally:
            CALL_SECONDS.labels(req.op).observe(time.perf_counter() - start)

    async def reset(self, req: EnvRequest) -> EnvReply:
        if req.session_id not in self.sessions and len(self.sessions) >= self.max_sessions:
            return self.error(req, "session_lost", f"worker hosts its maximum of {self.max_sessions} sessions")
        try:
            cls = self.env_class(req.env)
        except ValueError as e:
            return self.error(req, "bad_request", str(e))
        self.drop(req.session_id)  # a redelivered reset starts the session afresh

        def make_and_reset():  # one thread hop per request: hops, not env code, dominated cheap envs' latency
            env = cls.from_dict({**(req.task or {}), **req.env_args})
            return env, *env.reset()

        env, observation, info = await self.call(req, make_and_reset)
        self.sessions[req.session_id] = Session(env, req.run_id, req.env, req.session_ttl_s)
        SESSIONS.set(len(self.sessions))
        return self.ok(req, observation=observation, info=info or {})

    async def step(self, req: EnvRequest) -> EnvReply:
        session = self.sessions.get(req.session_id)
        if session is None:
            return self.error(req, "session_lost", f"session {req.session_id} is not hosted by {self.worker_id}")
        session.last_used = time.monotonic()
        env = session.env

        def step_and_finish():
            observation, reward, done, info = env.step(req.action)
            final = float(env.compute_final_reward()) if done and hasattr(env, "compute_final_reward") else None
            if done:  # nothing calls a finished env again: close it now and spare the trajectory a close request
                _close_quietly(env)
            return observation, reward, done, info, final

        observation, reward, done, info, final = await self.call(req, step_and_finish)
        session.last_used = time.monotonic()
        if done:
            self.drop(req.session_id)
        return self.ok(req, observation=observation, reward=float(reward), done=bool(done), info=info or {},
                       final_reward=final, closed=bool(done))

    async def close(self, req: EnvRequest) -> EnvReply:
        session = self.sessions.pop(req.session_id, None)
        SESSIONS.set(len(self.sessions))
        if session is not None:
            await self.call(req, session.env.close)
        return self.ok(req)

    def env_class(self, name: str) -> Any:
        if name not in self._classes:
            self._classes[name] = resolve("env", name)
        return self._classes[name]

    def drop(self, session_id: str) -> None:
        """Forget a session without calling into it (it may be stuck or broken)."""
        if self.sessions.pop(session_id, None) is not None:
            SESSIONS.set(len(self.sessions))

    def expire_idle(self) -> list[tuple[str, Session]]:
        now = time.monotonic()
        idle = [(sid, s) for sid, s in self.sessions.items() if now - s.last_used > s.ttl_s]
        for sid, session in idle:
            del self.sessions[sid]
            self.pool.submit(_close_quietly, session.env)
            EXPIRED.inc()
            log.info("session %s (env %s) idle for %.0fs: closed", sid, session.env_name, now - session.last_used,
                     extra={"run_id": session.run_id})
        SESSIONS.set(len(self.sessions))
        return idle

    def ok(self, req: EnvRequest, **fields: Any) -> EnvReply:
        return EnvReply(request_id=req.request_id, session_id=req.session_id, env_worker_id=self.worker_id,
                        ok=True, **fields)

    def error(self, req: EnvRequest, kind: str, message: str) -> EnvReply:
        return EnvReply(request_id=req.request_id, session_id=req.session_id, env_worker_id=self.worker_id,
                        ok=False, error=message, error_kind=kind)

    def error_from_reply(self, reply: EnvReply, message: str) -> EnvReply:
        return EnvReply(request_id=reply.request_id, session_id=reply.session_id, env_worker_id=self.worker_id,
                        ok=False, error=message, error_kind="user", elapsed_ms=reply.elapsed_ms)

    def shutdown(self) -> None:
        for session in self.sessions.values():
            self.pool.submit(_close_quietly, session.env)
        self.sessions.clear()
        self.pool.shutdown(wait=False, cancel_futures=False)


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception:
        log.warning("env close raised", exc_info=True)
