"""External agent programs: `POST /v1/runs/{id}/sessions` hands a runner the next session of a run.

Sessions live in the rollout workers (each dispatched (task, sample) of an `"agent_program": {"name": "external"}`
run waits at the worker that took it, services/rollout_worker/gateway.py). The API forwards the claim to the live
workers' gateways, found through their heartbeats (`gateway_url`), and returns the first session one hands out;
the runner then talks to that worker directly (`base_url`, `reward_url`), so model calls never pass through the
API. A claim forwarded to a worker that answers too late is lost to this caller: its session ends as a timeout
(recorded, re-dispatched like any failed attempt), never double-assigned."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Annotated

import httpx
from fastapi import APIRouter, Path, Request, Response

from services.api.deps import Config
from services.api.errors import ApiError, errors
from services.api.run_refs import resolve_run
from services.api.schemas import AgentSessionPublic, ClaimRequest
from shared.contracts.db.models import TERMINAL_RUN_STATUSES, Run
from shared.contracts.registry import EXTERNAL_AGENT_PROGRAM
from shared.platform.bus import RedisError, SyncRedis
from shared.platform.heartbeats import live_workers

router = APIRouter(prefix="/runs", tags=["agent programs"])
POLL_S = 1.0  # with several workers, how long each is asked to wait before the next is asked


@router.post("/{run_id}/sessions", response_model=AgentSessionPublic,
             responses={204: {"description": "no session of the run came free within wait_s"},
                        **errors(400, 404, 409, 422, 502, 503)})
async def claim_session(run_id: Annotated[str, Path(min_length=1, max_length=200, description="the run's id, a "
                                                   "unique prefix of its id, or its name")],
                        request: Request, config: Config,
                        body: ClaimRequest | None = None) -> Response | dict:
    # Not the request-scoped DB session: a long poll would hold a pooled connection for its whole wait, and a
    # few dozen waiting runners would exhaust the pool (every other route then fails).
    run_id = await asyncio.to_thread(_check_run, request.app.state.sessions, run_id)
    deadline = time.monotonic() + (body or ClaimRequest()).wait_s
    http: httpx.AsyncClient = request.app.state.gateway_http
    while True:
        round_started = time.monotonic()
        gateways = await asyncio.to_thread(live_gateways, request.app.state.redis)
        if not gateways:  # nothing to wait on: say so now instead of holding the runner for wait_s
            raise ApiError(503, "no live rollout worker serves the agent gateway, so no session can come free",
                           hint="start a rollout worker (`docker compose up` starts one); retry after a second",
                           headers={"Retry-After": "1"})
        for url in random.sample(gateways, len(gateways)):  # no worker's sessions wait behind another's
            left = max(0.0, deadline - time.monotonic())
            session = await _claim_at(http, url, run_id, left if len(gateways) == 1 else min(left, POLL_S),
                                      config.gateway_token)
            if session is not None:
                return session
        if time.monotonic() >= deadline:
            return Response(status_code=204)
        if time.monotonic() - round_started < 0.2:  # the workers did not answer (restarting): no busy loop
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _check_run(sessions, ref: str) -> uuid.UUID:
    """The id of the run `ref` names (id, id prefix or name), when it takes external sessions now."""
    with sessions() as db:
        run_id = resolve_run(db, ref)
        run = db.get(Run, run_id)
    if run is None:
        raise ApiError(404, f"run {run_id} not found")
    program = (run.config or {}).get("agent_program") or {}
    if program.get("name") != EXTERNAL_AGENT_PROGRAM:
        raise ApiError(400, f"run {run_id} does not take external agent programs", field="agent_program.name",
                       hint='create the run with "agent_program": {"name": "external"}')
    if run.status in TERMINAL_RUN_STATUSES:
        raise ApiError(409, f"run {run_id} is {run.status}: it hands out no more sessions")
    return run_id


def live_gateways(redis_client: SyncRedis) -> list[str]:
    """The gateway URLs live rollout workers advertise in their heartbeats."""
    try:
        workers = live_workers(redis_client, "rollout-worker")
    except RedisError as e:
        raise ApiError(503, f"Redis is unreachable, so no rollout worker can be found: {e}") from e
    return [w.gateway_url for w in workers if w.gateway_url]


async def _claim_at(http: httpx.AsyncClient, gateway: str, run_id: uuid.UUID, wait_s: float,
                    token: str | None) -> dict | None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = await http.post(f"{gateway}/v1/runs/{run_id}/sessions", json={"wait_s": wait_s}, headers=headers,
                               timeout=wait_s + 10.0)
    except httpx.TransportError:  # that worker is gone or restarting: its heartbeat will lapse
        return None
    if resp.status_code == 401:
        raise ApiError(502, f"the rollout worker at {gateway} refused the API's claim",
                       hint="set GATEWAY_TOKEN for the API to the rollout workers' GATEWAY_TOKEN")
    if resp.status_code != 200:
        return None
    return resp.json()
