"""Open routes: liveness, readiness (Redis + Postgres reachable) and Prometheus metrics (requests, queue depths
of every stream: length, pending and lag per consumer group, dead-letter lengths)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from sqlalchemy import func, select, text
from sqlalchemy.exc import SQLAlchemyError

from services.api.schemas import Health, Readiness
from shared.contracts import streams
from shared.contracts.db.models import RUN_STATUSES, Run
from shared.platform.bus import RedisError, stream_stats
from shared.platform.heartbeats import live_workers

router = APIRouter(tags=["system"])
STREAM_LENGTH = Gauge("stream_length", "XLEN of a stream", ["stream"])
STREAM_PENDING = Gauge("stream_pending", "Entries delivered and not acknowledged", ["stream", "group"])
STREAM_LAG = Gauge("stream_lag", "Entries not yet delivered to the group", ["stream", "group"])
DEAD_LETTERS = Gauge("stream_dead_letters", "XLEN of a stream's dead-letter stream", ["stream"])
RUNS_BY_STATUS = Gauge("runs", "Runs by status", ["status"])
MONITORED_STREAMS = (streams.ROLLOUT_TASKS, streams.ENV_REQUESTS, streams.TRAJECTORIES, streams.ACCEPTED_RESULTS,
                     streams.TRAINER_PROGRESS, streams.WEIGHTS, streams.RUN_COMMANDS, streams.RUN_CONTROL,
                     streams.JOB_REQUESTS)


@router.get("/healthz", response_model=Health)
def healthz() -> dict:
    return {"status": "ok", "service": "api"}


@router.get("/readyz", response_model=Readiness,
            responses={503: {"model": Readiness, "description": "Redis or Postgres is unreachable"}})
def readyz(request: Request, response: Response) -> dict:
    checks = {"redis": _redis_ok(request), "postgres": _postgres_ok(request)}
    response.status_code = 200 if all(checks.values()) else 503
    return {"ready": all(checks.values()), **checks}


CUT_OFF = {  # what a service that cannot reach Postgres holds up
    "controller": "nothing is dispatched or stored, and no stall reason written, until it can",
    "trainer": "no training step is recorded until it can",
}


def dependency_outage(request: Request) -> str | None:
    """Why runs cannot move right now, for the run views (Postgres answered the API: they were read from it;
    a controller or trainer may still be cut off from it, as its heartbeat says)."""
    if not _redis_ok(request):
        return ("Redis is unreachable: no rollout task or result can move, so this run's numbers stay frozen "
                "until it is back (GET /readyz; the local stack restarts its embedded Redis)")
    try:
        cut = [(s, b.worker_id) for s in CUT_OFF for b in live_workers(request.app.state.redis, s)
               if "postgres" in b.unreachable]
    except RedisError:
        return None
    if cut:
        return "; ".join(f"{s} {w} cannot reach PostgreSQL (its heartbeat says so): {CUT_OFF[s]}" for s, w in cut)
    return None


def _redis_ok(request: Request) -> bool:
    try:
        return bool(request.app.state.redis.ping())
    except RedisError:
        return False


def _postgres_ok(request: Request) -> bool:
    try:
        with request.app.state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except SQLAlchemyError:
        return False


@router.get("/metrics", response_class=PlainTextResponse, responses={200: {
    "description": "Prometheus text exposition format",
    "content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(request: Request) -> Response:
    try:
        _observe_streams(request.app.state.redis)
    except RedisError:
        pass  # Redis down: serve the request metrics anyway; /readyz reports the outage
    try:
        _observe_runs(request)
    except SQLAlchemyError:
        pass
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _observe_streams(r) -> None:
    for name in MONITORED_STREAMS:
        stats = stream_stats(r, name)
        STREAM_LENGTH.labels(name).set(stats.length)
        DEAD_LETTERS.labels(name).set(stats.dead_letters)
        for g in stats.groups:
            STREAM_PENDING.labels(name, g.name).set(g.pending)
            STREAM_LAG.labels(name, g.name).set(g.lag)


def _observe_runs(request: Request) -> None:
    with request.app.state.engine.connect() as conn:
        counts = dict(conn.execute(select(Run.status, func.count()).group_by(Run.status)).all())
    for status in RUN_STATUSES:
        RUNS_BY_STATUS.labels(status).set(counts.get(status, 0))
