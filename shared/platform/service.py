"""The one skeleton every service process runs on. A service's `main` is its settings and a `build`:

    def main() -> int:
        return run_service(EnvWorkerSettings(), build, dependencies=("redis",))

`run_service` logs the resolved config once with its secrets masked, runs the loops on uvloop beside
`/healthz`, `/readyz`, `/metrics`, a heartbeat and signal handling, and shuts down bounded and idempotent. A
loop that dies makes the process exit non-zero. `/healthz` is liveness, `/readyz` readiness (dependencies).

More: docs/reliability.md#the-service-process
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from shared.contracts.messages.codec import set_max_entry_bytes
from shared.contracts.streams import heartbeat_key
from shared.platform.bus import connect
from shared.platform.db.session import DB_DOWN
from shared.platform.logs import get_logger, setup_logging
from shared.platform.settings import ServiceSettings
from shared.platform.tracing import setup_tracing

log = get_logger(__name__)
UP = Gauge("service_up", "1 while the service loop runs", ["service"])


Loops = list[Coroutine[Any, Any, Any]]
S = TypeVar("S", bound=ServiceSettings)
T = TypeVar("T")


def run_service(
    settings: S, build: Callable[[S, ServiceRuntime], Awaitable[Loops]] | None = None, *,
    dependencies: tuple[str, ...] = ("redis", "postgres"), shutdown_timeout_s: float = 20.0,
    foreground: Callable[[S], object] | None = None,
) -> int:
    """Run a service process (module docstring); returns its exit code.

    `build(settings, runtime)` creates the service's parts, registers their cleanups with `runtime.on_stop`
    and returns its loops ([] when HTTP is all it serves). `foreground(settings)`, for a framework that owns the
    main thread and its signals (Celery), runs in the main thread while the runtime runs beside it in a thread
    without signal handlers; the runtime stops when `foreground` returns or raises, and a runtime that stops on
    its own (a loop died) sends this process SIGTERM, so the foreground does not go on without its loops."""
    setup_service(settings)
    runtime = ServiceRuntime(settings, settings.service_name, shutdown_timeout_s=shutdown_timeout_s,
                             dependencies=dependencies, handle_signals=foreground is None)

    async def serve() -> int:
        return await runtime.run(await build(settings, runtime) if build is not None else [])

    if foreground is None:
        return _event_loop_run(serve())
    codes: list[int] = []
    foreground_done = threading.Event()

    def run_runtime() -> None:
        codes.append(_event_loop_run(serve()))
        if not foreground_done.is_set():  # a loop died: the foreground stops too (warm, as on SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run_runtime, name="runtime", daemon=True)
    thread.start()
    try:
        foreground(settings)
    finally:
        foreground_done.set()
        runtime.stop_threadsafe()
        thread.join(timeout=shutdown_timeout_s + 5)
    return codes[0] if codes else 1


def setup_service(settings: ServiceSettings) -> None:
    """Logging and tracing for this process, and its resolved config logged once, secrets masked.
    `run_service` calls it; a process that does not run the service (a trainer rank > 0) calls it alone."""
    setup_logging(settings.service_name, settings.log_level, settings.log_format)
    setup_tracing(settings.service_name, settings.otel_exporter_otlp_endpoint)
    log.info("%s config: %s", settings.service_name, settings.loggable())


def _event_loop_run(main: Coroutine[Any, Any, int]) -> int:
    """uvloop when installed (EVENT_LOOP=asyncio opts out): the services spend most of their CPU in event-loop
    and socket work, which uvloop does in C."""
    if os.environ.get("EVENT_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


async def wait_for(aw: Awaitable[T], seconds: float | None) -> T:
    """`asyncio.wait_for` that never loses a cancellation: `aw`'s result, TimeoutError after `seconds`. Python
    3.11's wait_for returns the result when a cancel lands as `aw` completes, so a cancelled loop went on (a
    service that would not stop); asyncio.timeout hands the cancel on. Services use this one, never asyncio's."""
    async with asyncio.timeout(seconds):
        return await aw


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`, waking at once when `stop` is set; returns whether it was set. Periodic loops
    use it so that shutdown never waits out a full interval."""
    try:
        await wait_for(stop.wait(), seconds)
        return True
    except TimeoutError:
        return False


def default_worker_id(service: str) -> str:
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


READINESS_TIMEOUT_S = 2.0
POSTGRES_PROBE_S = 5.0  # how often the heartbeat says whether Postgres answers this process


class ServiceRuntime:
    def __init__(self, settings: ServiceSettings, service: str, *, shutdown_timeout_s: float = 20.0,
                 dependencies: tuple[str, ...] = ("redis", "postgres"), handle_signals: bool = True):
        unknown = set(dependencies) - {"redis", "postgres"}
        if unknown:
            raise ValueError(f"unknown dependencies {sorted(unknown)}: readiness checks exist for redis, postgres")
        self.settings = settings
        self.service = service
        self.dependencies = dependencies
        self.worker_id = settings.worker_id or default_worker_id(service)
        self.stop = asyncio.Event()
        self.shutdown_timeout_s = shutdown_timeout_s
        self.handle_signals = handle_signals  # False where another framework owns the main thread (Celery)
        self._cleanups: list[Callable[[], Awaitable[None] | None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.status: dict[str, Any] = {}  # extra fields reported by /healthz and the heartbeat
        self.checks: list[Callable[[], Awaitable[bool]]] = []
        self.started_at = time.time()
        # Listening now, answered once the service is built: a port taken while the service imports (minutes under
        # load) is an error at start, not a process that runs on and never answers its health checks. (Bound alone,
        # it could still be bound by another SO_REUSEADDR socket; a listening one cannot.)
        self._sock = _bind(settings.health_host, settings.health_port)
        self.port: int = self._sock.getsockname()[1]
        self.redis = connect(settings.redis_url)
        set_max_entry_bytes(settings.max_entry_bytes)  # every reader in this process refuses larger entries
        self.app = self._build_app()  # served on HEALTH_HOST:HEALTH_PORT; a service may replace it with its own

    def on_stop(self, cleanup: Callable[[], Awaitable[None] | None]) -> None:
        """Call `cleanup` (sync or async) at shutdown, after the loops ended; the last registered runs first, so
        a part is closed before what it uses."""
        self._cleanups.append(cleanup)

    def stop_threadsafe(self) -> None:
        """Ask the service to stop from another thread (set `stop` directly when on the loop's own thread)."""
        if self._loop is None or self._loop.is_closed():
            self.stop.set()
        else:
            self._loop.call_soon_threadsafe(self.stop.set)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title=f"{self.service} health", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/healthz")
        async def healthz() -> Response:
            ok = not self.stop.is_set() and all([await c() for c in self.checks])
            return Response(json.dumps(self.health()), status_code=200 if ok else 503, media_type="application/json")

        @app.get("/readyz")
        async def readyz() -> Response:
            reachable = await self.reachable()
            ok = not self.stop.is_set() and all(reachable.values()) and all([await c() for c in self.checks])
            body = {"ready": ok, "service": self.service, "worker_id": self.worker_id, **reachable}
            return Response(json.dumps(body), status_code=200 if ok else 503, media_type="application/json")

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

        return app

    async def reachable(self) -> dict[str, bool]:
        """Whether each dependency answers now, each within READINESS_TIMEOUT_S."""
        probes = {"redis": self._redis_answers, "postgres": self._postgres_answers}
        answers = await asyncio.gather(*(_within(probes[d](), READINESS_TIMEOUT_S) for d in self.dependencies))
        return dict(zip(self.dependencies, answers, strict=True))

    async def _redis_answers(self) -> bool:
        return bool(await self.redis.ping())

    async def _postgres_answers(self) -> bool:
        import psycopg
        from sqlalchemy.engine import make_url

        # A connection per probe, not the service's pool: the probe must not queue behind busy work.
        url = make_url(self.settings.database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        async with await psycopg.AsyncConnection.connect(url, connect_timeout=2) as conn:
            await conn.execute("SELECT 1")
        return True

    def health(self) -> dict[str, Any]:
        return {
            "service": self.service, "worker_id": self.worker_id, "pid": os.getpid(), "port": self.port,
            "uptime_s": round(time.time() - self.started_at, 1), "stopping": self.stop.is_set(), **self.status,
        }

    async def _heartbeat(self) -> None:
        key = heartbeat_key(self.service, self.worker_id)
        ttl_ms = int(self.settings.heartbeat_interval_s * 3000)
        next_probe = 0.0
        while not self.stop.is_set():
            if "postgres" in self.dependencies and time.monotonic() >= next_probe:
                # Said in the heartbeat, so that others can tell why this process makes no progress (the API's
                # run view names a controller or trainer cut off from Postgres; neither can write it there)
                next_probe = time.monotonic() + POSTGRES_PROBE_S
                if await _within(self._postgres_answers(), READINESS_TIMEOUT_S):
                    self.status.pop("unreachable", None)
                else:
                    self.status["unreachable"] = ["postgres"]
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
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=10)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # the runtime owns signals
        task = asyncio.create_task(server.serve(sockets=[self._sock]))
        await self.stop.wait()
        server.should_exit = True
        await task

    def _install_signals(self) -> None:
        if not self.handle_signals:
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)

    async def run(self, loops: list[Coroutine[Any, Any, Any]]) -> int:
        """Run the service's loops until a signal or a loop failure, then shut down (loops, then the `on_stop`
        cleanups) within `shutdown_timeout_s`; returns the process exit code."""
        self._loop = asyncio.get_running_loop()
        # What start-up imported and built (transformers alone: millions of objects) stays out of the cyclic
        # collector's full passes, which otherwise stalled the event loop ~0.2 s each under load.
        gc.freeze()
        self._install_signals()
        UP.labels(self.service).set(1)
        tasks = [asyncio.create_task(c) for c in loops]
        http, beat = asyncio.create_task(self._serve_http()), asyncio.create_task(self._heartbeat())
        stop_wait = asyncio.create_task(self.stop.wait())
        # The HTTP server is watched as a loop is: a service whose health port stopped serving exits.
        done, _ = await asyncio.wait([*tasks, http, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        for t in done:
            if t is not stop_wait and t.exception() is not None:
                log.error("%s %s died", self.service, "HTTP server" if t is http else "loop",
                          exc_info=t.exception())
                code = 1
        log.info("%s stopping (worker %s)", self.service, self.worker_id)
        self.stop.set()
        UP.labels(self.service).set(0)
        try:
            await wait_for(self._shutdown(tasks, http), self.shutdown_timeout_s)
        except TimeoutError:
            log.error("shutdown exceeded %.0fs; cancelling", self.shutdown_timeout_s)
            for t in tasks:
                t.cancel()
            code = code or 1
        for t in (http, beat):
            t.cancel()
        await asyncio.gather(http, beat, return_exceptions=True)
        self._sock.close()
        await self.redis.aclose()
        return code

    async def _shutdown(self, tasks: list[asyncio.Task], http: asyncio.Task) -> None:
        # The loops end and the HTTP server finishes the requests in flight (uploads, API calls) before the
        # cleanups close what they use.
        await asyncio.gather(*tasks, http, return_exceptions=True)
        for cleanup in reversed(self._cleanups):
            try:
                if asyncio.iscoroutine(done := cleanup()):
                    await done
            except Exception:  # the other parts still get closed
                log.exception("%s: cleanup %r failed", self.service, cleanup)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror}): another process holds the port; "
                               "set HEALTH_PORT (or the service's own port setting) to a free one, 0 for any") from e
    return sock


async def _within(probe: Awaitable[bool], timeout_s: float) -> bool:
    """A probe's answer, or False when it fails or takes longer than timeout_s."""
    from redis.exceptions import RedisError

    try:
        return await wait_for(probe, timeout_s)
    except (TimeoutError, OSError, RedisError, *DB_DOWN):
        return False
