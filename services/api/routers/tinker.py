"""The Tinker protocol (the `tinker` SDK's routes under /api/v1): client config, sessions, server capabilities,
LoRA training models, their training operations (sent to the trainer on `tinker.ops.<model id>`) and the futures
their operations return. Auth is the SDK's `X-API-Key: tml-<token>`,
a flywheel token (API_TOKEN or an api_tokens row) behind `tml-`. Operations this server does not serve yet
answer 404 naming the operation (404 is what the SDK neither retries nor treats as a broken client).
More: docs/tinker.md"""

from __future__ import annotations

import asyncio
import collections
import re
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from google.protobuf.message import DecodeError
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, select

from services.api.auth import Principal, hash_token, needs, principal_for, required_scope
from services.api.deps import DB, Config
from services.api.errors import ApiError
from services.api.routers.runs import commanding
from services.api.tinker_base_models import base_models
from services.api.tinker_proto import (
    ForwardBackwardRequest,
    WireError,
    decode_datums,
    encode_output,
    encode_samples,
)
from services.api.tinker_store import TinkerStore
from shared.clients.run_commands import run_command
from shared.contracts.db.models import ApiToken, Run
from shared.contracts.messages import TinkerOp, TinkerSample, TinkerWake
from shared.contracts.messages.tinker import MAX_TOPK_LOGPROBS, AdamStep
from shared.contracts.streams import TINKER_REQUESTS, TINKER_SAMPLES, tinker_model_ops
from shared.contracts.tinker_run import (
    LOSS_CONFIG,
    LOSS_INPUTS,
    MODEL_TTL_S,
    TinkerRunConfig,
    checkpoint_path,
    parse_checkpoint_path,
)
from shared.platform.bus import RedisError, announce
from shared.platform.logs import get_logger

KEY_PREFIX = "tml-"
KEY_HINT = "send 'X-API-Key: tml-<flywheel token>' (TINKER_API_KEY=tml-$API_TOKEN, or tml- + a token of `flywheel tokens create`)"


@dataclass(frozen=True)
class Caller:
    principal: Principal
    owner: str  # sha256 of the flywheel token: what the caller's sessions, models and futures are filed under


def tinker_caller(request: Request) -> Caller:
    key = (request.headers.get("x-api-key") or "").strip()
    if not key:
        raise ApiError(401, "missing X-API-Key", hint=KEY_HINT)
    if not key.startswith(KEY_PREFIX):
        raise ApiError(401, "this server takes Tinker keys of the form tml-<flywheel token> (no JWTs yet)",
                       hint=KEY_HINT)
    token = key.removeprefix(KEY_PREFIX)
    principal = principal_for(request, token)
    if principal is None:
        raise ApiError(401, "invalid or revoked key", hint=KEY_HINT)
    scope = required_scope(request)
    if not principal.can(scope):
        raise ApiError(403, f"token {principal.name!r} lacks the {scope!r} scope this operation needs",
                       hint="create a token with that scope: `flywheel tokens create NAME --scope SCOPE`")
    return Caller(principal, hash_token(token))


Key = Annotated[Caller, Depends(tinker_caller)]
router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)


def store(request: Request) -> TinkerStore:
    return TinkerStore(request.app.state.redis)


class Wire(BaseModel):
    """A request body as the SDK sends it: fields this server does not use (`type`, newer ones) are ignored."""
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


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


class LoraConfig(Wire):
    rank: Annotated[int, Field(ge=1, le=1024)]
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(Wire):
    session_id: str
    model_seq_id: Annotated[int, Field(ge=0)]
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: dict[str, Any] = {"type": "adamw"}


class GetInfo(Wire):
    model_id: str


class RetrieveFuture(Wire):
    request_id: str


class OptimStep(Wire):
    model_id: str
    seq_id: int | None = None
    adam_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None


@router.post("/client/config")
@needs("read")
def client_config(_: Key) -> dict:
    # Everything that needs a server feature this slice lacks is off; the SDK's defaults cover the rest.
    return {"pjwt_auth_enabled": False, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
            "sample_join_sampling_session": False, "proto_compress_fwdbwd": False}


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


@router.post("/create_session")
def create_session(body: CreateSession, caller: Key, request: Request) -> dict:
    session_id = store(request).create_session(caller.owner, body.tags, body.user_metadata or {},
                                               owner_name=caller.principal.name, display_name=body.display_name,
                                               project_id=body.project_id)
    return {"type": "create_session", "session_id": session_id}


def owned_session(request: Request, caller: Caller, session_id: str, field: str) -> dict:
    record = store(request).session(caller.owner, session_id)
    if record is None:
        raise ApiError(404, f"session {session_id} does not exist", field=field,
                       hint="create one with POST /api/v1/create_session (the SDK's ServiceClient does)")
    return record


@router.get("/sessions")
@needs("read")
def list_sessions(caller: Key, request: Request, limit: Annotated[int, Field(ge=1, le=1000)] = 20,
                  offset: Annotated[int, Field(ge=0)] = 0) -> dict:
    """The key's sessions, newest first (`access_scope` is not read: a key reaches only its own)."""
    return {"sessions": store(request).sessions(caller.owner, offset, limit)}


FINISH_REASONS = ("success", "errored", "interrupted")


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
    owned_session(request, caller, session_id, "path.session_id")
    store(request).set_session_project(caller.owner, session_id, body.project_id)


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
    tinker.finish_session(caller.owner, session_id, str(body.reason.get("type", "")), body.detail)
    with commanding():  # the session's training runs end with it (a stopped run stays stopped: not applied again)
        for run_id in tinker.session_members(session_id, "runs"):
            run_command(db, request.app.state.redis, run_id, "stop", wait_s=config.run_command_wait_s)


@router.post("/create_model")
def create_model(body: CreateModel, caller: Key, request: Request, config: Config, db: DB) -> dict:
    if body.lora_config is None:
        raise ApiError(400, "only LoRA training models are served: give a lora_config", field="lora_config")
    model_id = new_model(request, caller, config, db, body.session_id, body.model_seq_id, body.base_model,
                         body.lora_config.model_dump(), body.optimizer_config, body.user_metadata)
    request_id = store(request).complete(caller.owner, {"type": "create_model", "model_id": model_id}, model_id)
    return {"request_id": request_id, "model_id": model_id}


def offered_model(config, name: str):
    offered = base_models(config.tinker_base_models, config.data_dir)
    if name not in offered:
        supported = ", ".join(offered) or "none (set TINKER_BASE_MODELS or add model folders to DATA_DIR/models)"
        raise ApiError(400, f"base model {name!r} is not offered by this server", field="base_model",
                       hint=f"supported: {supported}")
    return offered[name]


def new_model(request: Request, caller: Caller, config, db, session_id: str, model_seq_id: int, base_model: str,
              lora: dict, optimizer_config: dict, user_metadata: dict | None) -> str:
    """A LoRA training model: its record, and its run of kind `tinker` stored by the controller."""
    session = owned_session(request, caller, session_id, "session_id")
    if session["finished"] is not None:
        raise ApiError(400, f"session {session_id} has finished", field="session_id")
    base = offered_model(config, base_model)
    if optimizer_config.get("type", "adamw") != "adamw":
        raise ApiError(400, f"optimizer {optimizer_config.get('type')!r} is not supported; only adamw",
                       field="optimizer_config.type")
    model_id = f"{session_id}:train:{model_seq_id}"  # the id the SDK itself derives for a session's model
    tinker = store(request)
    model = {"session_id": session_id, "run_id": None, "base_model": base.name, "source": base.source,
             "arch": base.arch, "lora": lora, "optimizer_config": optimizer_config,
             "user_metadata": user_metadata or {}}
    if not tinker.put_model(caller.owner, model_id, model, only_new=True):
        # 400, not 409: the SDK retries a 409 as a lock timeout, and this will not change
        raise ApiError(400, f"model {model_id} exists already (model_seq_id {model_seq_id} is taken)",
                       field="model_seq_id")
    run = TinkerRunConfig(name=f"tinker {model_id}", model_id=model_id, session_id=session_id,
                          owner=caller.owner, owner_name=caller.principal.name, base_model=base.name,
                          model=base.source, lora=lora, optimizer=optimizer_config,
                          user_metadata=model["user_metadata"], engine=config.tinker_engine)
    try:
        run_id = store_run(request, caller, config, db, run)
    except BaseException:
        tinker.drop_model(model_id)  # no run, no model: the client may try again with the same id
        raise
    tinker.put_model(caller.owner, model_id, model | {"run_id": run_id})
    tinker.file_under_session(session_id, "models", model_id)
    return model_id


def store_run(request: Request, caller: Caller, config, db, run: TinkerRunConfig) -> str:
    """The run of a training model or a base sampling session, stored by the controller (the one writer of
    `runs`; 503 when none answers) and filed under its session (finishing the session stops it)."""
    run_id = uuid.uuid4()
    with commanding():
        reply = run_command(db, request.app.state.redis, run_id, "create", wait_s=config.run_command_wait_s,
                            config=run.model_dump(mode="json"), rows=0,
                            created_by=f"the tinker key of token {caller.principal.name!r}")
    if reply.outcome != "applied":
        raise ApiError(502, f"the controller refused the tinker run: {reply.message}",
                       hint="the API and the controller may run different versions; update both")
    store(request).file_under_session(run.session_id, "runs", str(run_id))
    return str(run_id)


@router.post("/get_info")
@needs("read")
def get_info(body: GetInfo, caller: Key, request: Request) -> dict:
    model = store(request).model(caller.owner, body.model_id)
    if model is None:
        raise ApiError(404, f"model {body.model_id} does not exist", field="model_id")
    return {"type": "get_info", "model_id": body.model_id, "model_name": model["base_model"],
            "model_data": {"arch": model["arch"], "model_name": model["base_model"], "tokenizer_id": model["source"]},
            "is_lora": True, "lora_rank": model["lora"]["rank"], "optimizer_config": model["optimizer_config"]}


LONG_POLL_S = 20.0  # a future not done is answered try_again after this long (the SDK waits 45 s per poll)
POLL_EVERY_S = (0.005, 0.05)  # how often the record is read meanwhile: from the first to the longest pause


@router.post("/retrieve_future")
@needs("read")
async def retrieve_future(body: RetrieveFuture, caller: Key, request: Request) -> dict:
    """The future's answer, long-polled: a future not done yet is answered when its result arrives, or try_again
    after LONG_POLL_S (the SDK polls again at once after a try_again: answering at once would have each waiting
    client spin on the API)."""
    tinker, deadline, pause = store(request), time.monotonic() + LONG_POLL_S, POLL_EVERY_S[0]
    while True:
        future = await run_in_threadpool(tinker.future, caller.owner, body.request_id)
        if future is None:  # another key's future reads as absent: ids of others' work are not confirmed
            raise ApiError(404, f"future {body.request_id} does not exist (or has expired)", field="request_id")
        if future["result"].get("type") != "try_again" or time.monotonic() >= deadline:
            break
        await asyncio.sleep(pause)
        pause = min(2 * pause, POLL_EVERY_S[1])
    result = future["result"]
    if result.get("type") == "forward_backward":  # the SDK reads ForwardBackwardOutput as protobuf
        return Response(encode_output(result), media_type="application/x-protobuf")
    if result.get("type") == "sample":  # and SampleResponse
        return Response(encode_samples(result), media_type="application/x-protobuf")
    return result


def owned_model(request: Request, caller: Caller, model_id: str, field: str = "model_id", *,
                training: bool = True) -> dict:
    """The key's model; with `training`, one that can be trained on (not the holder of a copy_weights copy)."""
    model = store(request).model(caller.owner, model_id)
    if model is None or (model.get("run_id") is None and model.get("copy_of") is None):
        raise ApiError(404, f"model {model_id} does not exist", field=field,
                       hint="create one with create_lora_training_client (POST /api/v1/create_model)")
    if training and model.get("copy_of"):
        raise ApiError(400, f"model {model_id} holds a copy of {model['copy_of']} and cannot be trained on",
                       field=field, hint="train a model made from the copy: create_training_client_from_state")
    return model


def send_op(request: Request, caller: Caller, model: dict, **op) -> dict:
    """Store the operation's future (`try_again`), put the operation on its model's stream (where the trainer
    holding the model reads it, in order), then wake the trainers (one takes the model if none holds it); the
    SDK's future answer."""
    tinker, redis, model_id = store(request), request.app.state.redis, op["model_id"]
    try:
        request_id = tinker.pending(caller.owner, model_id)
        ops = tinker_model_ops(model_id)
        announce(redis, ops, TinkerOp(request_id=request_id, owner=caller.owner, run_id=model["run_id"],
                                      sent_at=time.time(), **op))
        redis.expire(ops, MODEL_TTL_S)  # outlives the model (a week after its creation)
        announce(redis, TINKER_REQUESTS, TinkerWake(model_id=model_id, run_id=model["run_id"]))
    except RedisError as e:
        raise ApiError(503, f"Redis is unreachable, so the operation could not be sent to a trainer ({e})",
                       hint="retry once Redis is back") from e
    return {"request_id": request_id, "model_id": op["model_id"]}


@router.post("/forward_backward")
async def forward_backward(request: Request, caller: Key) -> dict:
    """The SDK's protobuf ForwardBackwardRequest (`forward_only` for `forward`), checked here datum by datum."""
    if request.headers.get("content-encoding"):
        raise ApiError(415, f"Content-Encoding {request.headers['content-encoding']!r} is not accepted",
                       hint="the client config turns compression off (proto_compress_fwdbwd: false)")
    msg = ForwardBackwardRequest()
    try:
        msg.ParseFromString(await request.body())
    except DecodeError as e:
        raise ApiError(400, f"the body is not a protobuf ForwardBackwardRequest ({e})",
                       hint="send it as the tinker SDK does (Content-Type: application/x-protobuf)") from e
    return await run_in_threadpool(_forward_backward, request, caller, msg)


def _forward_backward(request: Request, caller: Caller, msg) -> dict:
    model = owned_model(request, caller, msg.model_id)
    if msg.loss_fn not in LOSS_INPUTS:
        raise ApiError(400, f"loss {msg.loss_fn!r} is not served", field="forward_backward_input.loss_fn",
                       hint=f"served losses: {', '.join(LOSS_INPUTS)}")
    if not msg.data:
        raise ApiError(400, "no datums", field="forward_backward_input.data")
    try:
        data = decode_datums(msg, LOSS_INPUTS)
    except WireError as e:
        raise ApiError(400, e.message, field=e.field, hint=e.hint) from e
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
    config = config or dict(msg.loss_fn_config)
    known = LOSS_CONFIG.get(msg.loss_fn, {})
    for key in [k for k in config if k not in known] + [k for k, v in known.items() if v is None and k not in config]:
        raise ApiError(400, f"loss {msg.loss_fn!r} {'has no' if key in config else 'needs the'} loss_fn_config "
                       f"{key!r}", field=f"forward_backward_input.loss_fn_config.{key}",
                       hint=f"its config: {', '.join(known) or 'none'}")
    return send_op(request, caller, model, model_id=msg.model_id, seq_id=msg.seq_id, data=data,
                   op="forward" if msg.forward_only else "forward_backward", loss_fn=msg.loss_fn,
                   loss_fn_config=config)


@router.post("/optim_step")
def optim_step(body: OptimStep, caller: Key, request: Request) -> dict:
    model = owned_model(request, caller, body.model_id)
    if body.adam_params is None:
        raise ApiError(400, "only Adam steps are served: send adam_params", field="optimizer_params",
                       hint="models here are created with the adamw optimizer")
    try:
        adam = AdamStep.model_validate(body.adam_params)
    except ValidationError as e:
        raise ApiError(400, f"bad adam_params: {e.errors()[0]['msg']}",
                       field="adam_params." + ".".join(map(str, e.errors()[0]["loc"]))) from e
    return send_op(request, caller, model, model_id=body.model_id, seq_id=body.seq_id or 0, op="optim_step",
                   adam=adam)


class SaveWeights(Wire):
    model_id: str
    path: str | None = None  # the checkpoint's name
    seq_id: int | None = None
    ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL_S)] | None = None  # None: kept until deleted
    overwrite: bool = False  # replace a checkpoint of that name (otherwise saving over one is refused)
    user_metadata: dict[str, str] | None = None  # kept with the checkpoint, shown by its listings
    sampling_session_seq_id: int | None = None  # save_weights_and_get_sampling_client: a sampler of these weights


class LoadWeights(Wire):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None  # create-via-load: a new model, its LoRA config that of the checkpoint
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: dict[str, Any] | None = None


NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _save(body: SaveWeights, caller: Caller, request: Request, op: str) -> dict:
    model = owned_model(request, caller, body.model_id)
    seq_id = body.seq_id or 0
    name = body.path or (f"sampler-{seq_id:06d}" if op == "save_weights_for_sampler" else f"{seq_id:06d}")
    if not NAME.fullmatch(name):
        raise ApiError(400, f"checkpoint name {name!r} is not 1-128 letters, digits, '.', '_' or '-'", field="path")
    kind = "sampler_weights" if op == "save_weights_for_sampler" else "weights"
    if not body.overwrite and store(request).checkpoint(caller.owner, checkpoint_path(body.model_id, kind, name)):
        # 400, not 409: the SDK retries a 409 as a lock timeout, and this will not change
        raise ApiError(400, f"checkpoint {checkpoint_path(body.model_id, kind, name)} exists already", field="path",
                       hint="save under another name, or pass overwrite=True to replace it")
    store(request).publish(checkpoint_path(body.model_id, kind, name), False)  # a checkpoint saved starts private
    sampler_id = None
    if op == "save_weights_for_sampler" and body.sampling_session_seq_id is not None:
        # the trainer publishes these weights as version seq_id of the model's run: the sampler serves that
        sampler_id = f"{model['session_id']}:sample:{body.sampling_session_seq_id}"
        store(request).put_sampler(caller.owner, sampler_id, model["session_id"], {
            "run_id": model["run_id"], "version": seq_id, "base_model": model["base_model"],
            "model_path": checkpoint_path(body.model_id, "sampler_weights", name)})
    return send_op(request, caller, model, model_id=body.model_id, seq_id=seq_id, op=op, name=name,
                   sampling_session_id=sampler_id, ttl_s=body.ttl_seconds, user_metadata=body.user_metadata or {})


@router.post("/save_weights")
def save_weights(body: SaveWeights, caller: Key, request: Request) -> dict:
    """save_state: adapter and Adam state, tinker://<model>/weights/<name>."""
    return _save(body, caller, request, "save_weights")


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeights, caller: Key, request: Request) -> dict:
    """The adapter for sampling, tinker://<model>/sampler_weights/<name> (a version on the weight server)."""
    return _save(body, caller, request, "save_weights_for_sampler")


@router.post("/load_weights")
def load_weights(body: LoadWeights, caller: Key, request: Request, config: Config, db: DB) -> dict:
    """load_state(_with_optimizer) onto a model, or a new model made from the checkpoint (create-via-load)."""
    parsed = parse_checkpoint_path(body.path)
    if parsed is None or parsed[1] != "weights":
        raise ApiError(400, f"{body.path!r} is not a save_state checkpoint path", field="path",
                       hint="tinker://<model id>/weights/<name>, as save_state returned it")
    saved = store(request).readable_checkpoint(caller.owner, body.path)
    if saved is None:
        raise ApiError(404, f"checkpoint {body.path} does not exist", field="path",
                       hint="a key loads its own checkpoints and those their owners published")
    model_id, seq_id = body.model_id, body.seq_id or 0
    if model_id is None:
        if body.session_id is None or body.model_seq_id is None:
            raise ApiError(400, "give model_id, or session_id and model_seq_id to make a model from the checkpoint",
                           field="model_id")
        model_id = new_model(request, caller, config, db, body.session_id, body.model_seq_id,
                             body.base_model or saved["base_model"], saved["lora"],
                             body.optimizer_config or {"type": "adamw"}, body.user_metadata)
    model = owned_model(request, caller, model_id)
    return send_op(request, caller, model, model_id=model_id, seq_id=seq_id, op="load_weights", path=body.path,
                   optimizer=body.optimizer)


# -- sampling -----------------------------------------------------------------------------------------------------
class CreateSamplingSession(Wire):
    session_id: str
    sampling_session_seq_id: Annotated[int, Field(ge=0)]
    base_model: str | None = None
    model_path: str | None = None


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSession, caller: Key, request: Request, config: Config,
                            db: DB) -> dict:
    """A sampler of saved sampler weights (`model_path`) or of a base model (a run of its own, its samples
    stored as that run's episodes)."""
    session = owned_session(request, caller, body.session_id, "session_id")
    if session["finished"] is not None:
        raise ApiError(400, f"session {body.session_id} has finished", field="session_id")
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    if body.model_path is not None:
        parsed = parse_checkpoint_path(body.model_path)
        saved = store(request).readable_checkpoint(caller.owner, body.model_path) if parsed else None
        if parsed is None or parsed[1] != "sampler_weights":
            raise ApiError(400, f"{body.model_path!r} is not a sampler weights path", field="model_path",
                           hint="tinker://<model id>/sampler_weights/<name>, as save_weights_for_sampler returned it")
        if saved is None:
            raise ApiError(404, f"sampler weights {body.model_path} do not exist", field="model_path")
        record = {"run_id": saved["run_id"], "version": saved["version"], "base_model": saved["base_model"],
                  "model_path": body.model_path}
    elif body.base_model is not None:
        base = offered_model(config, body.base_model)
        run = TinkerRunConfig(name=f"tinker sampler {sampler_id}", model_id=sampler_id, session_id=body.session_id,
                              owner=caller.owner, owner_name=caller.principal.name, base_model=base.name,
                              model=base.source, lora=None, engine=config.tinker_engine)
        record = {"run_id": store_run(request, caller, config, db, run), "version": 0, "base_model": base.name,
                  "model_path": None}
    else:
        raise ApiError(400, "give base_model or model_path", field="base_model")
    store(request).put_sampler(caller.owner, sampler_id, body.session_id, record)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
@needs("read")
def get_sampler(sampler_id: str, caller: Key, request: Request) -> dict:
    sampler = store(request).sampler(caller.owner, sampler_id)
    if sampler is None:
        raise ApiError(404, f"sampler {sampler_id} does not exist", field="path.sampler_id")
    return {"sampler_id": sampler_id, "base_model": sampler["base_model"], "model_path": sampler["model_path"]}


class SampleParams(Wire):
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_k: int = -1
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0


class SampleRequest(Wire):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    num_samples: Annotated[int, Field(ge=1, le=1024)] = 1
    prompt: dict[str, Any]
    sampling_params: SampleParams
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    prompt_logprobs_last_n: Annotated[int, Field(ge=1)] | None = None
    topk_prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOPK_LOGPROBS)] = 0
    topk_sample_logprobs: Annotated[int, Field(ge=0, le=MAX_TOPK_LOGPROBS)] = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0


DEFAULT_MAX_TOKENS = 256  # a sample request without max_tokens
MAX_TTL_S = 10 * 365 * 86400  # the SDK documents ten years as the longest ttl


def prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    tokens = []
    for j, chunk in enumerate(prompt.get("chunks", [])):
        if chunk.get("type") != "encoded_text":
            raise ApiError(400, f"only text chunks (encoded_text) are served, not {chunk.get('type')!r}",
                           field=f"prompt.chunks[{j}]")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    if not tokens:
        raise ApiError(400, "the prompt is empty", field="prompt")
    return tokens


@router.post("/asample")
def asample(body: SampleRequest, caller: Key, request: Request) -> dict:
    if body.sampling_session_id is None:
        raise ApiError(400, "sample through a sampling session (the SDK's SamplingClient)", field="sampling_session_id")
    sampler = store(request).sampler(caller.owner, body.sampling_session_id)
    if sampler is None:
        raise ApiError(404, f"sampling session {body.sampling_session_id} does not exist", field="sampling_session_id")
    unserved = [f for f in ("target_prompt_logprobs", "prompt_alt_tokens_k") if getattr(body, f)]
    if unserved:
        raise ApiError(400, f"{unserved[0]} is not served by this server yet", field=unserved[0],
                       hint="sample without it (prompt_logprobs and the top-k logprobs are served)")
    prompt = prompt_tokens(body.prompt)
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and (not (body.prompt_logprobs or body.topk_prompt_logprobs) or last_n >= len(prompt)):
        raise ApiError(400, f"prompt_logprobs_last_n {last_n} needs prompt logprobs asked for and a prompt longer "
                       f"than it (this prompt has {len(prompt)} tokens)", field="prompt_logprobs_last_n",
                       hint="between 1 and len(prompt) - 1, with prompt_logprobs or topk_prompt_logprobs")
    p = body.sampling_params
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    try:
        request_id = store(request).pending(caller.owner, None)
        sequence_ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
        announce(request.app.state.redis, TINKER_SAMPLES, TinkerSample(
            request_id=request_id, owner=caller.owner, run_id=sampler["run_id"], version=sampler["version"],
            sequence_ids=sequence_ids, prompt=prompt, num_samples=body.num_samples,
            max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            stop_strings=[x for x in stop if isinstance(x, str)], stop_tokens=[x for x in stop if isinstance(x, int)],
            prompt_logprobs=bool(body.prompt_logprobs), prompt_logprobs_last_n=last_n,
            topk_prompt_logprobs=body.topk_prompt_logprobs, topk_sample_logprobs=body.topk_sample_logprobs,
            seed=p.seed,
            sent_at=time.time()))
    except RedisError as e:
        raise ApiError(503, f"Redis is unreachable, so the sample could not be sent to a rollout worker ({e})",
                       hint="retry once Redis is back") from e
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}


# -- the RestClient's listings ---------------------------------------------------------------------------------
def path_of(record: dict) -> str:
    return checkpoint_path(record["model_id"], record["kind"], record["name"])


def checkpoint_view(record: dict, public: set[str]) -> dict:
    """A TinkerCheckpoint as the SDK's Checkpoint; `public`: the published paths among those shown."""
    path = path_of(record)
    expires = record.get("expires_at")
    return {"checkpoint_id": f"{record['kind']}/{record['name']}",
            "checkpoint_type": "training" if record["kind"] == "weights" else "sampler",
            "time": datetime.fromtimestamp(record["created_at"], UTC).isoformat(), "tinker_path": path,
            "public": path in public, "expires_at": datetime.fromtimestamp(expires, UTC).isoformat() if expires else None,
            "user_metadata": record.get("user_metadata") or None}


def training_run_view(run: Run, checkpoints: list[dict], public: set[str]) -> dict:
    cfg = TinkerRunConfig.model_validate(run.config)
    last = {kind: next((checkpoint_view(c, public) for c in reversed(checkpoints) if c["kind"] == kind), None)
            for kind in ("weights", "sampler_weights")}
    return {"training_run_id": cfg.model_id, "base_model": cfg.base_model, "model_owner": cfg.owner_name,
            "is_lora": True, "corrupted": run.status == "failed", "lora_rank": cfg.lora["rank"],
            "last_request_time": (run.updated_at or run.created_at).isoformat(), "last_checkpoint": last["weights"],
            "last_sampler_checkpoint": last["sampler_weights"],
            "user_metadata": {k: str(v) for k, v in cfg.user_metadata.items()} or None}


def owned_runs(caller: Caller):
    """The key's training models' runs (not its base samplers'), newest first."""
    return (select(Run).where(Run.kind == "tinker", Run.config["owner"].astext == caller.owner,
                              Run.config["lora"].astext.isnot(None))  # ->> of a JSON null is NULL
            .order_by(Run.created_at.desc()))


@router.get("/training_runs")
@needs("read")
def list_training_runs(caller: Key, request: Request, db: DB, limit: Annotated[int, Field(ge=1, le=1000)] = 20,
                       offset: Annotated[int, Field(ge=0)] = 0, project_id: str | None = None) -> dict:
    query = owned_runs(caller)
    if project_id is not None:  # the runs of the key's sessions in that project
        sessions = [i for i, r in store(request).session_records(caller.owner) if r.get("project_id") == project_id]
        query = query.where(Run.config["session_id"].astext.in_(sessions))
    total = db.execute(select(func.count()).select_from(query.subquery())).scalar_one()
    runs = db.execute(query.limit(limit).offset(offset)).scalars().all()
    tinker = store(request)
    saved = {r.config["model_id"]: tinker.checkpoints(caller.owner, r.config["model_id"]) for r in runs}
    public = tinker.published([path_of(c) for records in saved.values() for c in records])
    return {"training_runs": [training_run_view(r, saved[r.config["model_id"]], public) for r in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


def owned_training_run(request: Request, caller: Caller, db, model_id: str) -> Run:
    model = owned_model(request, caller, model_id, field="path.training_run_id", training=False)
    if model.get("copy_of"):
        raise ApiError(404, f"model {model_id} holds a copy of {model['copy_of']}, not a training run",
                       field="path.training_run_id", hint=f"list_checkpoints({model_id!r}) lists the copy")
    return db.get(Run, uuid.UUID(model["run_id"]))


@router.get("/training_runs/{model_id}")
@needs("read")
def get_training_run(model_id: str, caller: Key, request: Request, db: DB) -> dict:
    run = owned_training_run(request, caller, db, model_id)
    records = store(request).checkpoints(caller.owner, model_id)
    return training_run_view(run, records, store(request).published([path_of(c) for c in records]))


@router.get("/training_runs/{model_id}/checkpoints")
@needs("read")
def list_checkpoints(model_id: str, caller: Key, request: Request) -> dict:
    owned_model(request, caller, model_id, field="path.training_run_id", training=False)
    records = store(request).checkpoints(caller.owner, model_id)
    public = store(request).published([path_of(c) for c in records])
    return {"checkpoints": [checkpoint_view(c, public) for c in records]}


@router.get("/checkpoints")
@needs("read")
def list_user_checkpoints(caller: Key, request: Request, limit: Annotated[int, Field(ge=1, le=1000)] = 100,
                          offset: Annotated[int, Field(ge=0)] = 0) -> dict:
    records = list(reversed(store(request).checkpoints(caller.owner)))  # newest first
    page = records[offset:offset + limit]
    public = store(request).published([path_of(c) for c in page])
    return {"checkpoints": [checkpoint_view(c, public) for c in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(records)}}


def owned_checkpoint(request: Request, caller: Caller, model_id: str, kind: str, name: str) -> str:
    """The tinker:// path of the key's live checkpoint `<kind>/<name>` (the SDK's checkpoint id) of model
    `model_id`; 404 otherwise."""
    owned_model(request, caller, model_id, field="path.training_run_id", training=False)
    path = checkpoint_path(model_id, kind, name)
    if parse_checkpoint_path(path) is None or store(request).checkpoint(caller.owner, path) is None:
        raise ApiError(404, f"checkpoint {kind}/{name} of {model_id} does not exist", field="path.checkpoint_id",
                       hint="weights/<name> or sampler_weights/<name>, as list_checkpoints shows them")
    return path


# A checkpoint id is <kind>/<name>: two path segments, so .../<kind>/<name>/publish is not taken for one
CHECKPOINT = "/training_runs/{model_id}/checkpoints/{kind}/{name}"


@router.delete(CHECKPOINT, status_code=204)
def delete_checkpoint(model_id: str, kind: str, name: str, caller: Key, request: Request) -> None:
    """Gone at once (never listed or loaded again); the trainer then removes its files and record."""
    path = owned_checkpoint(request, caller, model_id, kind, name)
    store(request).expire_checkpoint(caller.owner, path, time.time())
    store(request).publish(path, False)


class CheckpointTtl(Wire):
    ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL_S)] | None


@router.put(CHECKPOINT + "/ttl", status_code=204)
def set_checkpoint_ttl(model_id: str, kind: str, name: str, body: CheckpointTtl, caller: Key, request: Request) -> None:
    """Expire the checkpoint `ttl_seconds` from now, or (None) keep it until deleted."""
    path = owned_checkpoint(request, caller, model_id, kind, name)
    store(request).expire_checkpoint(caller.owner, path, time.time() + body.ttl_seconds if body.ttl_seconds else None)


@router.post(CHECKPOINT + "/publish", status_code=204)
def publish_checkpoint(model_id: str, kind: str, name: str, caller: Key, request: Request) -> None:
    """Any key may then load it (load_state, create_training_client_from_state) or sample it (a sampler of its
    sampler weights); only its owner can publish it (another key's checkpoint is 404, as everywhere)."""
    store(request).publish(owned_checkpoint(request, caller, model_id, kind, name), True)


@router.delete(CHECKPOINT + "/publish", status_code=204)
def unpublish_checkpoint(model_id: str, kind: str, name: str, caller: Key, request: Request) -> None:
    """Private again: other keys' loads and new samplers of it are refused (404) from now on."""
    store(request).publish(owned_checkpoint(request, caller, model_id, kind, name), False)


class CopyWeights(Wire):
    source_path: str
    session_id: str | None = None
    model_seq_id: Annotated[int, Field(ge=0)] | None = None
    destination_project_id: Annotated[str, Field(min_length=1)] | None = None
    ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL_S)] | None = None
    weights_access_token: str | None = None


COPY_REPLAY_S = 86400  # how long a copy's idempotency key answers a retry with the same copy


@router.post("/copy_weights")
def copy_weights(body: CopyWeights, caller: Key, request: Request, config: Config) -> dict:
    """Sampler weights (the key's own or published ones) copied into a new model slot that cannot be trained
    on: `session_id` + `model_seq_id`, or a new session in `destination_project_id`. The copy shares the
    source's storage (its version on the weight server) and has its own expiry. A retry with the same
    X-Idempotency-Key is answered with the copy the first made."""
    tinker = store(request)
    replay = request.headers.get("x-idempotency-key")
    if replay and (done := tinker.copy_made(caller.owner, replay)):
        return {"tinker_path": done}
    if body.weights_access_token or request.headers.get("x-tinker-weights-access-token"):
        raise ApiError(400, "weights access tokens are not served", field="weights_access_token",
                       hint="the checkpoint's owner publishes it (publish_checkpoint_from_tinker_path); any key "
                            "may then copy it")
    parsed = parse_checkpoint_path(body.source_path)
    source = tinker.readable_checkpoint(caller.owner, body.source_path) if parsed else None
    if source is None:
        raise ApiError(404, f"checkpoint {body.source_path} does not exist", field="source_path",
                       hint="a key copies its own checkpoints and those their owners published")
    if source["kind"] != "sampler_weights":
        # the trainer removes a save_state's folder with its record: a copy sharing it would break with either
        raise ApiError(400, "copying save_state (weights) checkpoints is not served yet; sampler weights are",
                       field="source_path", hint="create_training_client_from_state(path) and save_state anew")
    session_id, seq = copy_slot(request, caller, body)
    model_id = f"{session_id}:train:{seq}"
    base = offered_model(config, source["base_model"])
    model = {"session_id": session_id, "run_id": None, "copy_of": body.source_path, "base_model": base.name,
             "source": base.source, "arch": base.arch, "lora": source["lora"], "optimizer_config": None,
             "user_metadata": {}}
    if not tinker.put_model(caller.owner, model_id, model, only_new=True):
        raise ApiError(400, f"model {model_id} exists already (model_seq_id {seq} is taken)", field="model_seq_id")
    tinker.file_under_session(session_id, "models", model_id)
    expires = time.time() + body.ttl_seconds if body.ttl_seconds else None
    path = tinker.put_copy(caller.owner, source, model_id, expires)
    if replay:
        tinker.remember_copy(caller.owner, replay, path, COPY_REPLAY_S)
    return {"tinker_path": path}


def copy_slot(request: Request, caller: Caller, body: CopyWeights) -> tuple[str, int]:
    """Where a copy goes: the given session's slot, or slot 0 of a new session in the given project."""
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise ApiError(400, "give model_seq_id with session_id", field="model_seq_id")
        if owned_session(request, caller, body.session_id, "session_id")["finished"] is not None:
            raise ApiError(400, f"session {body.session_id} has finished", field="session_id")
        return body.session_id, body.model_seq_id
    if body.destination_project_id is None:
        raise ApiError(400, "give destination_project_id, or session_id and model_seq_id", field="destination_project_id")
    return store(request).create_session(caller.owner, [], {}, owner_name=caller.principal.name,
                                         project_id=body.destination_project_id), 0


class WeightsInfo(Wire):
    tinker_path: str


@router.post("/weights_info")
@needs("read")
def weights_info(body: WeightsInfo, caller: Key, request: Request) -> dict:
    saved = store(request).readable_checkpoint(caller.owner, body.tinker_path)
    if saved is None:
        raise ApiError(404, f"checkpoint {body.tinker_path} does not exist", field="tinker_path")
    lora = saved["lora"]
    return {"base_model": saved["base_model"], "is_lora": True, "lora_rank": lora["rank"],
            "train_unembed": lora.get("train_unembed"), "train_mlp": lora.get("train_mlp"),
            "train_attn": lora.get("train_attn")}


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


# Every other route the SDK (0.38.0) calls: what it is, so the caller learns the operation is not served yet.
NOT_SERVED = {
    "/save_weights_external": "save_weights_external",
    "/join_sampling_session": "join_sampling_session",
    "/retrieve_futures": "retrieve_futures", "/cancel_future": "cancel_future",
    "/create_custom_loss": "create_custom_loss",
    "/auth/token": "auth_token (JWT exchange: keys here are tml-<flywheel token>, used as they are)",
    "/training_runs/{rest:path}": "external weights URLs",
    "/sessions/{session_id}/{rest:path}": "session trace export",
    "/audit": "audit log (this server records no audit events)",
    "/billing/{rest:path}": "billing usage (this server keeps no usage, cost or storage-size records)",
}


def _not_served(operation: str):
    def not_served(request: Request, _: Key) -> None:
        raise ApiError(404, f"Tinker operation {operation!r} ({request.method} {request.url.path}) is not supported "
                       "by this flywheel server yet", hint="docs/tinker.md lists the operations served")
    not_served.__name__ = "tinker_not_served"
    return needs("read")(not_served)  # any key learns what is missing (a 403 would break the SDK's start)


for _path, _operation in NOT_SERVED.items():
    router.add_api_route(_path, _not_served(_operation), methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
