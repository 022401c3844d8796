"""What every long-lived service process has: `/healthz` and `/metrics` over HTTP, a heartbeat key in Redis,
signal handling, and a bounded, idempotent shutdown. A service supplies its loops as coroutines:

    runtime = ServiceRuntime(settings, "env-worker")
    await runtime.run([worker.serve(runtime.stop)], on_stop=worker.close)

If any loop dies with an exception the runtime logs it and exits non-zero (a dead background task never
goes unnoticed); `/healthz` reports 503 once the service is stopping or a check fails.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from shared.bus import connect
from shared.logs import get_logger
from shared.messages.codec import set_max_entry_bytes
from shared.settings import ServiceSettings
from shared.streams import heartbeat_key

log = get_logger(__name__)
UP = Gauge("service_up", "1 while the service loop runs", ["service"])


def run_service(main: Coroutine[Any, Any, int]) -> int:
    """Run a service's main coroutine on uvloop when it is installed (EVENT_LOOP=asyncio opts out): the
    services spend most of their CPU in event-loop and socket work, which uvloop does in C."""
    if os.environ.get("EVENT_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`, waking at once when `stop` is set; returns whether it was set. Periodic loops
    use it so that shutdown never waits out a full interval."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except TimeoutError:
        return False


def default_worker_id(service: str) -> str:
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


class ServiceRuntime:
    def __init__(self, settings: ServiceSettings, service: str, *, shutdown_timeout_s: float = 20.0):
        self.settings = settings
        self.service = service
        self.worker_id = settings.worker_id or default_worker_id(service)
        self.stop = asyncio.Event()
        self.shutdown_timeout_s = shutdown_timeout_s
        self.status: dict[str, Any] = {}  # extra fields reported by /healthz and the heartbeat
        self.checks: list[Callable[[], Awaitable[bool]]] = []
        self.started_at = time.time()
        self.port: int | None = None
        self.redis = connect(settings.redis_url)
        set_max_entry_bytes(settings.max_entry_bytes)  # every reader in this process refuses larger entries
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title=f"{self.service} health", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/healthz")
        async def healthz() -> Response:
            ok = not self.stop.is_set() and all([await c() for c in self.checks])
            return Response(json.dumps(self.health()), status_code=200 if ok else 503, media_type="application/json")

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

        return app

    def health(self) -> dict[str, Any]:
        return {
            "service": self.service, "worker_id": self.worker_id, "pid": os.getpid(), "port": self.port,
            "uptime_s": round(time.time() - self.started_at, 1), "stopping": self.stop.is_set(), **self.status,
        }

    async def _heartbeat(self) -> None:
        key = heartbeat_key(self.service, self.worker_id)
        ttl_ms = int(self.settings.heartbeat_interval_s * 3000)
        while not self.stop.is_set():
            try:
                await self.redis.set(key, json.dumps(self.health()), px=ttl_ms)
            except Exception as e:  # Redis down: keep serving, the heartbeat resumes with it
                log.warning("heartbeat failed: %r", e)
            await sleep_or_stop(self.stop, self.settings.heartbeat_interval_s)
        try:
            await self.redis.delete(key)
        except Exception:
            pass

    async def _serve_http(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", self.settings.health_port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # the runtime owns signals
        task = asyncio.create_task(server.serve(sockets=[sock]))
        await self.stop.wait()
        server.should_exit = True
        await task

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)

    async def run(
        self, loops: list[Coroutine[Any, Any, Any]], on_stop: Callable[[], Awaitable[None]] | None = None
    ) -> int:
        """Run the service's loops until a signal or a loop failure; returns the process exit code."""
        # What start-up imported and built (transformers alone: millions of objects) stays out of the cyclic
        # collector's full passes, which otherwise stalled the event loop ~0.2 s each under load.
        gc.freeze()
        self._install_signals()
        UP.labels(self.service).set(1)
        tasks = [asyncio.create_task(c) for c in loops]
        infra = [asyncio.create_task(self._serve_http()), asyncio.create_task(self._heartbeat())]
        stop_wait = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait([*tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        for t in done:
            if t is not stop_wait and t.exception() is not None:
                log.error("%s loop died", self.service, exc_info=t.exception())
                code = 1
        log.info("%s stopping (worker %s)", self.service, self.worker_id)
        self.stop.set()
        UP.labels(self.service).set(0)
        try:
            await asyncio.wait_for(self._shutdown(tasks, on_stop), self.shutdown_timeout_s)
        except TimeoutError:
            log.error("shutdown exceeded %.0fs; cancelling", self.shutdown_timeout_s)
            for t in tasks:
                t.cancel()
            code = code or 1
        for t in infra:
            t.cancel()
        await asyncio.gather(*infra, return_exceptions=True)
        await self.redis.aclose()
        return code

    async def _shutdown(self, tasks: list[asyncio.Task], on_stop: Callable[[], Awaitable[None]] | None) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        if on_stop is not None:
            await on_stop()
