"""The API assembled in one place: state (engine, Redis), routers, error handlers, metrics,
and the dashboard's static files. services/api/main.py serves it on the service runtime (heartbeat, signals)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import Counter, Histogram

from services.api.auth import authorize
from services.api.errors import add_error_handlers, errors
from services.api.routers import agent_sessions, datasets, jobs, runs, sql, system, tokens, trajectories
from services.api.routers import tinker as tinker_routes
from services.api.settings import ApiSettings
from shared.platform.bus import connect_sync
from shared.platform.db.session import make_engine, session_factory

STATIC_DIR = Path(__file__).parent / "static"
REQUESTS = Counter("api_requests_total", "HTTP requests", ["method", "handler", "status"])
LATENCY = Histogram("api_request_seconds", "HTTP request latency, seconds", ["method", "handler"])


def create_app(config: ApiSettings) -> FastAPI:
    app = FastAPI(title="flywheel", version="0.1.0", description="RL post-training for LLM agents: control plane")
    engine = make_engine(config.database_url)
    app.state.config = config
    app.state.engine = engine
    app.state.sessions = session_factory(engine)
    app.state.redis = connect_sync(config.redis_url, timeout_s=5)
    # Forwards agent-session claims to the rollout workers (routers/agent_sessions.py); one per process so
    # connections are reused. No connection cap: each forwarded claim holds one for its long poll, and a cap
    # would queue claims behind claims (bounded anyway by the requests the API is serving).
    app.state.gateway_http = httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_connections=None))
    _add_routes(app)
    add_error_handlers(app)
    _add_metrics_middleware(app)
    app.mount("/ui", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
    return app


def _add_routes(app: FastAPI) -> None:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)], responses=errors(401, 403))
    for module in (runs, agent_sessions, trajectories, datasets, jobs, tokens, sql):
        v1.include_router(module.router)
    app.include_router(v1)
    app.include_router(system.router)
    app.include_router(tinker_routes.router)  # the `tinker` SDK's protocol, with its own key auth (docs/tinker.md)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/")


def _add_metrics_middleware(app: FastAPI) -> None:
    @app.middleware("http")
    async def observe(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        route = getattr(request.scope.get("endpoint"), "__name__", "unmatched")  # low-cardinality label
        REQUESTS.labels(request.method, route, str(response.status_code)).inc()
        LATENCY.labels(request.method, route).observe(time.perf_counter() - start)
        return response
