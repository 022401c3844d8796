"""Session traces (the SDK's export_session_trace): a session's training and sampling requests on a timeline,
one lane per model or sampler, each request from when the API took it to when its result was written. The
trace is Chrome's trace-event JSON, which ui.perfetto.dev opens; it is built when its signed URL is fetched."""

from __future__ import annotations

import json
import time
from urllib.parse import quote

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from services.api import signing
from services.api.auth import needs
from services.api.deps import Config
from services.api.routers.tinker.callers import Key, check_signed_url, owned_session, store, url_key

router = APIRouter()


def chrome_trace(session_id: str, traced: list[tuple[dict, dict | None]], now: float) -> dict:
    """Each traced request as a complete event ("X"): its lane (thread) the model or sampler it was for, its
    state finished, failed or pending (drawn up to `now`), or unknown once its future expired (drawn as an
    instant)."""
    lanes: dict[str, int] = {}
    events = []
    for start, future in traced:
        lane = lanes.setdefault(start["target"], len(lanes) + 1)
        t0 = float(start["t"])
        answered = (future or {}).get("answered_at")
        if future is None:
            state, t1 = "unknown", t0
        elif answered is None:
            state, t1 = "pending", now
        else:
            state, t1 = ("failed" if "error" in future["result"] else "finished"), answered
        events.append({"name": start["name"], "cat": "sampling" if start["name"] == "sample" else "training",
                       "ph": "X", "pid": 1, "tid": lane, "ts": round(t0 * 1e6), "dur": max(0, round((t1 - t0) * 1e6)),
                       "args": {"request_id": start["request_id"], "state": state}})
    names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": target}}
             for target, tid in lanes.items()]
    return {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"session {session_id}"}},
                            *names, *events], "displayTimeUnit": "ms"}


@router.get("/sessions/{session_id}/trace_export")
@needs("read")
def trace_export(session_id: str, caller: Key, request: Request, config: Config) -> dict:
    """Ready at once: a signed URL (SIGNED_URL_TTL_S) that builds the session's trace as it is then."""
    owned_session(request, caller, session_id, "path.session_id")
    url, _ = signing.signed_url(url_key(request), f"{request.base_url}api/v1", trace_path(session_id),
                                config.signed_url_ttl_s)
    return {"status": "ready", "url": url}


def trace_path(session_id: str) -> str:
    """The path (under /api/v1) of a session's trace, as signed."""
    return f"session_traces/{quote(session_id, safe='')}"


@router.get("/session_traces/{session_id}", include_in_schema=False)
async def download_trace(session_id: str, expires: int, signature: str, request: Request) -> Response:
    """The trace, for the holder of its signed URL (no key); 403 when the URL is altered or expired."""
    await check_signed_url(request, trace_path(session_id), expires, signature,
                           hint="ask export_session_trace for a fresh URL")
    traced = await run_in_threadpool(store(request).traced, session_id)
    body = json.dumps(chrome_trace(session_id, traced, time.time()))
    return Response(body, media_type="application/json",
                    headers={"content-disposition": f'attachment; filename="{session_id}.pftrace.json"'})
