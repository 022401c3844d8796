"""The API assembled in one place: state (engine, Redis, Celery client), routers, error handlers, metrics,
and the dashboard's static files."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path

import redis
from celery import Celery
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import Counter, Histogram
from sqlalchemy.exc import DataError, IntegrityError

from services.api.auth import authorize
from services.api.config import ApiConfig
from services.api.routers import datasets, jobs, runs, sql, system, tokens, trajectories
from shared.bus import connect
from shared.db.session import make_engine, session_factory
from shared.logs import get_logger
from shared.service import default_worker_id
from shared.streams import heartbeat_key

log = get_logger(__name__)
STATIC_DIR = Path(__file__).parent / "static"
REQUESTS = Counter("api_requests_total", "HTTP requests", ["method", "handler", "status"])
LATENCY = Histogram("api_request_seconds", "HTTP request latency, seconds", ["method", "handler"])


@asynccontextmanager
async def heartbeat(app: FastAPI):
    """The Redis heartbeat key every service keeps (heartbeat:api:<worker>), refreshed while the API runs."""
    config: ApiConfig = app.state.config
    key = heartbeat_key("api", config.worker_id or default_worker_id("api"))
    redis_async = connect(config.redis_url)

    async def beat() -> None:
        while True:
            try:
                await redis_async.set(key, json.dumps({"service": "api", "port": config.api_port}),
                                      px=int(config.heartbeat_interval_s * 3000))
            except Exception as e:  # Redis down: keep serving; /readyz reports it
                log.warning("heartbeat failed: %r", e)
            await asyncio.sleep(config.heartbeat_interval_s)

    task = asyncio.create_task(beat())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await redis_async.aclose()


def create_app(config: ApiConfig) -> FastAPI:
    app = FastAPI(title="flywheel", version="0.1.0", description="RL post-training for LLM agents: control plane",
                  lifespan=heartbeat)
    engine = make_engine(config.database_url)
    app.state.config = config
    app.state.engine = engine
    app.state.sessions = session_factory(engine)
    app.state.redis = redis.Redis.from_url(config.redis_url, socket_timeout=5, socket_connect_timeout=5)
    app.state.celery = Celery("flywheel-api", broker=config.redis_url)
    _add_routes(app)
    _add_error_handlers(app)
    _add_metrics_middleware(app)
    app.mount("/ui", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
    return app


def _add_routes(app: FastAPI) -> None:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    for module in (runs, trajectories, datasets, jobs, tokens, sql):
        v1.include_router(module.router)
    app.include_router(v1)
    app.include_router(system.router)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/")


def _field_errors(exc: RequestValidationError) -> list[dict]:
    # pydantic's ctx may hold the ValueError itself, which JSON cannot carry: keep loc, msg, type.
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type", "")}
            for e in exc.errors()]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _field_errors(exc)
        summary = "; ".join(".".join(str(p) for p in e["loc"] if p != "body") + ": " + e["msg"] for e in errors)
        return JSONResponse({"detail": errors, "message": summary}, status_code=422)

    @app.exception_handler(DataError)
    async def bad_value(request: Request, exc: DataError) -> JSONResponse:
        # Values Postgres refuses (a NUL byte in text, a number out of range): the input's fault, not ours.
        reason = str(exc.orig).splitlines()[0] if exc.orig else str(exc)
        return JSONResponse({"detail": f"invalid value: {reason}"}, status_code=422)

    @app.exception_handler(IntegrityError)
    async def conflict(request: Request, exc: IntegrityError) -> JSONResponse:
        reason = str(exc.orig).splitlines()[0] if exc.orig else str(exc)
        return JSONResponse({"detail": f"conflicts with stored data: {reason}"}, status_code=409)


def _add_metrics_middleware(app: FastAPI) -> None:
    @app.middleware("http")
    async def observe(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        route = getattr(request.scope.get("endpoint"), "__name__", "unmatched")  # low-cardinality label
        REQUESTS.labels(request.method, route, str(response.status_code)).inc()
        LATENCY.labels(request.method, route).observe(time.perf_counter() - start)
        return response
