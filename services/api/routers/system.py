"""Open routes: liveness, readiness (Redis + Postgres reachable) and Prometheus metrics (requests, queue depths
of every stream: length, pending and lag per consumer group, dead-letter lengths)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from redis.exceptions import RedisError, ResponseError
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from shared import streams

router = APIRouter(tags=["system"])
STREAM_LENGTH = Gauge("stream_length", "XLEN of a stream", ["stream"])
STREAM_PENDING = Gauge("stream_pending", "Entries delivered and not acknowledged", ["stream", "group"])
STREAM_LAG = Gauge("stream_lag", "Entries not yet delivered to the group", ["stream", "group"])
DEAD_LETTERS = Gauge("stream_dead_letters", "XLEN of a stream's dead-letter stream", ["stream"])
RUNS_BY_STATUS = Gauge("runs", "Runs by status", ["status"])
MONITORED_STREAMS = (streams.ROLLOUT_TASKS, streams.ENV_REQUESTS, streams.TRAJECTORIES, streams.WEIGHTS,
                     streams.RUN_EVENTS)


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok", "service": "api"}


@router.get("/readyz")
def readyz(request: Request, response: Response) -> dict:
    checks = {"redis": _redis_ok(request), "postgres": _postgres_ok(request)}
    response.status_code = 200 if all(checks.values()) else 503
    return {"ready": all(checks.values()), **checks}


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


@router.get("/metrics")
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
        STREAM_LENGTH.labels(name).set(r.xlen(name))
        DEAD_LETTERS.labels(name).set(r.xlen(streams.dead_letter(name)))
        try:
            groups = r.xinfo_groups(name)
        except ResponseError:  # the stream does not exist yet
            groups = []
        for g in groups:
            group = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            STREAM_PENDING.labels(name, group).set(g["pending"])
            STREAM_LAG.labels(name, group).set(g.get("lag") or 0)


def _observe_runs(request: Request) -> None:
    with request.app.state.engine.connect() as conn:
        counts = dict(conn.execute(text("SELECT status, count(*) FROM runs GROUP BY status")).all())
    from shared.db.models import RUN_STATUSES

    for status in RUN_STATUSES:
        RUNS_BY_STATUS.labels(status).set(counts.get(status, 0))
