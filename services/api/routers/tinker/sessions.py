"""Sessions: client config, the key itself (`tinker auth login` / `logout`, the JWT exchange), health, server capabilities (the
base models offered), sessions (create, list, search, project, heartbeat, finish) and the SDK's telemetry."""

from __future__ import annotations

import collections
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from prometheus_client import Counter
from pydantic import Field
from sqlalchemy import select

from services.api import signing
from services.api.auth import needs
from services.api.deps import DB, Config
from services.api.errors import ApiError
from services.api.routers.runs import commanding
from services.api.routers.tinker import audit
from services.api.routers.tinker.callers import KEY_HINT, Caller, Key, Wire, jwt_key, owned_session, store
from services.api.routers.tinker.not_served import NOT_SERVED
from services.api.tinker_base_models import OfferedModel, base_models
from shared.clients.run_commands import run_command
from shared.contracts.db.models import ApiToken
from shared.contracts.messages.control import MAX_REASON_CHARS, CommandAction
from shared.platform.logs import get_logger

router = APIRouter()


class CreateSession(Wire):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionProject(Wire):
    project_id: Annotated[str, Field(min_length=1, max_length=200)]


class Heartbeat(Wire):
    session_id: str


class FinishSession(Wire):
    reason: dict[str, Any] = {}
    detail: str | None = None


@router.post("/client/config")
@needs("read")
def client_config(_: Key, config: Config) -> dict:
    # Everything that needs a server feature this slice lacks is off; the SDK's defaults cover the rest.
    return {"pjwt_auth_enabled": config.tinker_jwt_ttl_s > 0, "sample_use_retrieve_futures": True,
            "custom_loss_server_side": False, "sample_join_sampling_session": True, "proto_compress_fwdbwd": False}


@router.post("/auth/token")
@needs("read")  # any live key may exchange itself: the JWT carries no more than the key does
def auth_token(caller: Key, request: Request, config: Config) -> dict:
    """The SDK's JWT exchange: a JWT standing for the caller's token, valid TINKER_JWT_TTL_S (the SDK refreshes
    it at half that). Every use checks the token again: revoking it ends its JWTs at once."""
    if config.tinker_jwt_ttl_s == 0:
        raise ApiError(404, "JWT exchange is off on this server (TINKER_JWT_TTL_S=0): send the tml- key itself",
                       hint=KEY_HINT)
    return {"jwt": signing.mint_jwt(jwt_key(request), caller.owner, caller.principal.name,
                                    f"flywheel@{request.base_url.netloc}", config.tinker_jwt_ttl_s)}


# The dynamic flags follow from what this server serves, which changes only with a new server version: a live
# client re-reads them hourly (the SDK's default is every five minutes).
DYNAMIC_CONFIG_REFRESH_S = 3600
CANCEL_BATCH = 64  # cancels a client sends at once, when cancelling is on


class ClientConfigRequest(Wire):
    sdk_version: str | None = None


@router.post("/client/dynamic_config")
@needs("read")
def client_dynamic_config(_: ClientConfigRequest, __: Key) -> dict:
    """The SDK's ClientDynamicConfigResponse. Sample cancelling (an abandoned sample's `cancel_future`) is on
    only where `cancel_future` is served; off, the SDK leaves an abandoned sample to finish (its result expires
    with its future)."""
    cancel = "/cancel_future" not in NOT_SERVED
    return {"refresh_interval_sec": DYNAMIC_CONFIG_REFRESH_S, "sample_cancel_enabled": cancel,
            "sample_cancel_max_batch_size": CANCEL_BATCH}


# -- the key itself (`tinker auth login` / `logout`) -------------------------------------------------------------
def key_view(request: Request, caller: Caller, row: ApiToken | None) -> dict:
    """The SDK's SelfApiKeyResponse of the presented key. Flywheel tokens have no numeric id, user or
    organisation: `key_id` is the token row's UUID as an integer (0: API_TOKEN, which has no row), the user is
    the token's name and the organisation is this server; flywheel's own fields follow."""
    scopes = sorted(caller.principal.scopes)
    created = row.created_at.isoformat() if row else None
    return {"key_id": row.id.int if row else 0, "name": caller.principal.name,
            "note": f"flywheel token, scopes {', '.join(scopes)}" + (f", created {created}" if created else
                                                                     " (the server's API_TOKEN)"),
            "details": {"org_details": {"name": f"flywheel at {request.base_url.netloc}"},
                        "user_details": {"email": caller.principal.name}},
            "token_id": str(row.id) if row else None, "scopes": scopes, "created_at": created,
            "revoked_at": row.revoked_at.isoformat() if row and row.revoked_at else None}


def token_row(db, caller: Caller) -> ApiToken | None:
    """The api_tokens row of the caller's key; None for API_TOKEN (auth has already checked the key)."""
    return db.execute(select(ApiToken).where(ApiToken.token_sha256 == caller.owner)).scalar_one_or_none()


@router.get("/auth/apikey/me")
def get_own_key(caller: Key, request: Request, db: DB) -> dict:
    return key_view(request, caller, token_row(db, caller))


@router.delete("/auth/apikey/me")
@needs("read")  # a key may always revoke itself, whatever its scopes: it gives up access, gains none
def revoke_own_key(caller: Key, request: Request, db: DB) -> dict:
    row = token_row(db, caller)
    if row is None:
        raise ApiError(400, "this key is the server's bootstrap API_TOKEN, which cannot be revoked",
                       hint="change API_TOKEN in the server's settings and restart the API; tokens made with "
                            "`flywheel tokens create` can be revoked")
    row.revoked_at = datetime.now(UTC)
    db.commit()
    return key_view(request, caller, row)


@router.get("/healthz")
def healthz(_: Key) -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def get_server_capabilities(_: Key, config: Config) -> dict:
    models = base_models(config.tinker_base_models, config.data_dir).values()
    return {"supported_models": [{"model_name": m.name, "max_context_length": m.max_context_length,
                                  "trainable": True, "sampleable": True} for m in models]}


def offered_model(config, name: str) -> OfferedModel:
    offered = base_models(config.tinker_base_models, config.data_dir)
    if name not in offered:
        supported = ", ".join(offered) or "none (set TINKER_BASE_MODELS or add model folders to DATA_DIR/models)"
        raise ApiError(400, f"base model {name!r} is not offered by this server", field="base_model",
                       hint=f"supported: {supported}")
    return offered[name]


@router.post("/create_session")
def create_session(body: CreateSession, caller: Key, request: Request) -> dict:
    session_id = store(request).create_session(caller.owner, body.tags, body.user_metadata or {},
                                               owner_name=caller.principal.name, display_name=body.display_name,
                                               project_id=body.project_id)
    return {"type": "create_session", "session_id": session_id}


@router.get("/sessions")
@needs("read")
def list_sessions(caller: Key, request: Request, limit: Annotated[int, Field(ge=1, le=1000)] = 20,
                  offset: Annotated[int, Field(ge=0)] = 0) -> dict:
    """The key's sessions, newest first (`access_scope` is not read: a key reaches only its own)."""
    return {"sessions": store(request).sessions(caller.owner, offset, limit)}


FINISH_REASONS = ("success", "errored", "interrupted")
RUN_END_OF_SESSION: dict[str, CommandAction] = {"success": "complete", "errored": "fail", "interrupted": "stop"}


class StatusQuery(Wire):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: Annotated[list[Literal[FINISH_REASONS]], Field(min_length=1)] | None = None


class SearchOwner(Wire):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = None


class SearchCursor(Wire):
    last_created_at: datetime
    last_session_id: str


class SessionSearch(Wire):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: Annotated[str, Field(min_length=1)] | None = None
    owner: SearchOwner = SearchOwner()
    statuses: Annotated[list[StatusQuery], Field(min_length=1)] | None = None
    limit: Annotated[int, Field(ge=1, le=200)] = 50
    cursor: SearchCursor | None = None


def session_status(record: dict) -> dict | None:
    """A session's SessionStatus: active until its client finishes it (sessions here are never cancelled or
    failed by the server); None for a finish reason the SDK does not know."""
    done = record["finished"]
    if done is None:
        return {"type": "active"}
    if done["reason"] not in FINISH_REASONS:
        return None
    return {"type": "client_finished", "reason": {"type": done["reason"]}, "detail": done["detail"]}


def search_matches(body: SessionSearch, session_id: str, record: dict) -> bool:
    name = (record.get("display_name") or "").lower()
    named = body.display_name is not None and all(w in name for w in body.display_name.lower().split())
    if (body.session_id is not None or body.display_name is not None) and not (session_id == body.session_id
                                                                                or named):
        return False  # session_id and display_name: either one matching is enough
    if body.project_ids is not None and record.get("project_id") not in body.project_ids:
        return False
    metadata = {k: str(v) for k, v in record["user_metadata"].items()}
    if any(metadata.get(k) != v for k, v in body.user_metadata.items()):
        return False
    status = session_status(record)
    return body.statuses is None or status is not None and any(
        q.type == status["type"] and (q.reasons is None or status["reason"]["type"] in q.reasons)
        for q in body.statuses)


@router.post("/sessions/search")
@needs("read")
def search_sessions(body: SessionSearch, caller: Key, request: Request) -> dict:
    """The key's sessions matching every filter, newest first, a page of `limit` after `cursor`. A key reaches
    only its own sessions, so owner `accessible` searches those too; owner `user` is refused."""
    if body.owner.type == "user":
        raise ApiError(400, "searching other users' sessions is not supported: a key reaches only its own",
                       field="owner", hint="search with owner {'type': 'own'} (the default)")
    tinker = store(request)
    found = [(datetime.fromtimestamp(record["created_at"], UTC), session_id, record)
             for session_id, record in tinker.session_records(caller.owner) if search_matches(body, session_id, record)]
    found.sort(key=lambda f: (f[0], f[1]), reverse=True)
    if body.cursor is not None:
        after = (body.cursor.last_created_at, body.cursor.last_session_id)
        found = [f for f in found if (f[0], f[1]) < after]
    page = found[:body.limit]
    saved = collections.Counter(c["model_id"] for c in tinker.checkpoints(caller.owner)) if page else {}
    sessions = [{"session_id": session_id, "created_at": created.isoformat(),
                 "owner": record.get("owner_name") or caller.principal.name,
                 "project_id": record.get("project_id") or "", "status": session_status(record),
                 "checkpoints_count": sum(saved.get(m, 0) for m in tinker.session_members(session_id, "models")),
                 "display_name": record.get("display_name"),
                 "user_metadata": {k: str(v) for k, v in record["user_metadata"].items()} or None}
                for created, session_id, record in page]
    more = len(found) > len(page)
    cursor = {"last_created_at": page[-1][0].isoformat(), "last_session_id": page[-1][1]} if more else None
    return {"sessions": sessions, "next_cursor": cursor}


@router.get("/sessions/{session_id}")
@needs("read")
def get_session(session_id: str, caller: Key, request: Request) -> dict:
    record = owned_session(request, caller, session_id, "path.session_id")
    tinker = store(request)
    return {"training_run_ids": tinker.session_members(session_id, "models"),
            "sampler_ids": tinker.session_members(session_id, "samplers"),
            "user_metadata": {k: str(v) for k, v in record["user_metadata"].items()} or None,
            "display_name": record.get("display_name")}


@router.put("/sessions/{session_id}/project", status_code=204)
def assign_session_project(session_id: str, body: SessionProject, caller: Key, request: Request) -> None:
    """Move the session, with its models and samplers, into a project: the label `search_sessions` and
    `list_training_runs(project_id=...)` filter by. Projects are per key: any name, nothing to create first."""
    previous = owned_session(request, caller, session_id, "path.session_id").get("project_id")
    store(request).set_session_project(caller.owner, session_id, body.project_id)
    audit.record(request, caller, "project_session_assigned", session_id=session_id, project_id=body.project_id,
                 previous_project_id=previous)


@router.post("/session_heartbeat")
def session_heartbeat(body: Heartbeat, caller: Key, request: Request) -> dict:
    if owned_session(request, caller, body.session_id, "session_id")["finished"] is not None:
        raise ApiError(410, f"session {body.session_id} has finished", field="session_id")  # the SDK stops beating
    store(request).touch_session(body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, body: FinishSession, caller: Key, request: Request, config: Config,
                   db: DB) -> None:
    owned_session(request, caller, session_id, "path.session_id")
    tinker = store(request)
    reason = str(body.reason.get("type", ""))
    tinker.finish_session(caller.owner, session_id, reason, body.detail)
    # The session's runs end with it, as its client says it ended: success completes them, errored fails them
    # with the client's detail as their error, interrupted (or a reason this server does not know) stops them.
    # A run that has ended stays as it ended: the command is refused and nothing changes.
    action, why = RUN_END_OF_SESSION.get(reason, "stop"), None
    if action == "fail":
        why = (f"its Tinker client ended session {session_id} as errored"
               + (f": {body.detail}" if body.detail else ""))[:MAX_REASON_CHARS]
    with commanding():
        for run_id in tinker.session_members(session_id, "runs"):
            run_command(db, request.app.state.redis, run_id, action, wait_s=config.run_command_wait_s, reason=why)


log = get_logger(__name__)
CLIENT_EVENTS = Counter("tinker_client_events_total", "Tinker SDK telemetry events received", ["event", "severity"])
EVENT_TYPES = {"SESSION_START", "SESSION_END", "UNHANDLED_EXCEPTION", "GENERIC_EVENT"}  # the SDK's EventType
SEVERITIES = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}


class TelemetryBatch(Wire):
    events: list[dict[str, Any]]
    session_id: str | None = None
    sdk_version: str | None = None
    platform: str | None = None


@router.post("/telemetry")
@needs("read")
def telemetry(body: TelemetryBatch, caller: Key) -> dict:
    """The SDK's telemetry: each event counted (`tinker_client_events_total`, labels bounded to the SDK's own
    values) and logged, a client's unhandled exception as a warning with its type, message and traceback: what
    failed on the client's side of a session is in the API's log."""
    for event in body.events:
        kind = event.get("event") if event.get("event") in EVENT_TYPES else "other"
        severity = str(event.get("severity", "INFO")).upper()
        CLIENT_EVENTS.labels(kind, severity if severity in SEVERITIES else "other").inc()
        where = {"tinker_session": body.session_id, "sdk_version": body.sdk_version, "owner": caller.principal.name}
        if kind == "UNHANDLED_EXCEPTION":
            log.warning("tinker client exception %s: %s\n%s", event.get("error_type"), event.get("error_message"),
                        event.get("traceback") or "", extra=where)
        else:
            log.info("tinker client event %s %s", kind, event.get("event_name") or "", extra=where)
    return {"status": "accepted"}
