"""Checkpoints: the RestClient's listings (training runs, their checkpoints, the key's checkpoints), a
checkpoint's delete, ttl and publish, copy_weights and weights_info."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Annotated
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import Field
from sqlalchemy import func, select
from starlette.background import BackgroundTask

from services.api import signing
from services.api.auth import needs
from services.api.deps import DB, Config
from services.api.errors import ApiError
from services.api.routers.tinker import audit
from services.api.routers.tinker.callers import (
    Caller,
    Key,
    Wire,
    check_signed_url,
    owned_model,
    owned_session,
    store,
    url_key,
)
from services.api.routers.tinker.sessions import offered_model
from shared.contracts.db.models import Run
from shared.contracts.messages import TinkerCheckpoint
from shared.contracts.streams import tinker_key
from shared.contracts.tinker_run import (
    TinkerRunConfig,
    checkpoint_path,
    parse_checkpoint_path,
    training_model_id,
)

router = APIRouter()

MAX_TTL_S = 10 * 365 * 86400  # the SDK documents ten years as the longest ttl


def path_of(record: dict) -> str:
    return checkpoint_path(record["model_id"], record["kind"], record["name"])


CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}  # the SDK's


def stored_bytes(record: dict) -> int | None:
    """What a checkpoint record stores; None for a record written before sizes were kept and without files."""
    files = record.get("files") or {}
    return record.get("size_bytes") or (sum(files.values()) if files else None)


def checkpoint_view(record: dict, public: set[str]) -> dict:
    """A TinkerCheckpoint as the SDK's Checkpoint; `public`: the published paths among those shown."""
    path = path_of(record)
    expires = record.get("expires_at")
    return {"checkpoint_id": f"{record['kind']}/{record['name']}", "checkpoint_type": CHECKPOINT_TYPES[record["kind"]],
            "size_bytes": stored_bytes(record),
            "time": datetime.fromtimestamp(record["created_at"], UTC).isoformat(), "tinker_path": path,
            "public": path in public, "expires_at": datetime.fromtimestamp(expires, UTC).isoformat() if expires else None,
            "user_metadata": record.get("user_metadata") or None}


def training_run_view(run: Run, checkpoints: list[dict], public: set[str]) -> dict:
    # never `corrupted`: an op changes a model whole or not at all, and a model whose weights a trainer restart
    # lost answers its next op with an error saying so. (A failed run is one its client ended as errored.)
    cfg = TinkerRunConfig.model_validate(run.config)
    last = {kind: next((checkpoint_view(c, public) for c in reversed(checkpoints) if c["kind"] == kind), None)
            for kind in ("weights", "sampler_weights")}
    return {"training_run_id": cfg.model_id, "base_model": cfg.base_model, "model_owner": cfg.owner_name,
            "is_lora": True, "corrupted": False, "lora_rank": cfg.lora["rank"],
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
                       hint="weights/<name>, sampler_weights/<name> or external_weights/<name>, as "
                            "list_checkpoints shows them")
    return path


# A checkpoint id is <kind>/<name>: two path segments, so .../<kind>/<name>/publish is not taken for one
CHECKPOINT = "/training_runs/{model_id}/checkpoints/{kind}/{name}"


@router.delete(CHECKPOINT, status_code=204)
def delete_checkpoint(model_id: str, kind: str, name: str, caller: Key, request: Request) -> None:
    """Gone at once (never listed or loaded again); the trainer then removes its files and record."""
    path = owned_checkpoint(request, caller, model_id, kind, name)
    store(request).expire_checkpoint(caller.owner, path, time.time())
    store(request).publish(path, False)
    audit.record(request, caller, "checkpoint_delete", tinker_path=path, model_id=model_id)


class CheckpointTtl(Wire):
    ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL_S)] | None


@router.put(CHECKPOINT + "/ttl", status_code=204)
def set_checkpoint_ttl(model_id: str, kind: str, name: str, body: CheckpointTtl, caller: Key, request: Request) -> None:
    """Expire the checkpoint `ttl_seconds` from now, or (None) keep it until deleted."""
    path = owned_checkpoint(request, caller, model_id, kind, name)
    store(request).expire_checkpoint(caller.owner, path, time.time() + body.ttl_seconds if body.ttl_seconds else None)
    audit.record(request, caller, "checkpoint_ttl_set", tinker_path=path, model_id=model_id, ttl_seconds=body.ttl_seconds)


@router.post(CHECKPOINT + "/publish", status_code=204)
def publish_checkpoint(model_id: str, kind: str, name: str, caller: Key, request: Request) -> None:
    """Any key may then load it (load_state, create_training_client_from_state) or sample it (a sampler of its
    sampler weights); only its owner can publish it (another key's checkpoint is 404, as everywhere)."""
    path = owned_checkpoint(request, caller, model_id, kind, name)
    store(request).publish(path, True)
    audit.record(request, caller, "checkpoint_publish", tinker_path=path, model_id=model_id)


@router.delete(CHECKPOINT + "/publish", status_code=204)
def unpublish_checkpoint(model_id: str, kind: str, name: str, caller: Key, request: Request) -> None:
    """Private again: other keys' loads and new samplers of it are refused (404) from now on."""
    path = owned_checkpoint(request, caller, model_id, kind, name)
    store(request).publish(path, False)
    audit.record(request, caller, "checkpoint_unpublish", tinker_path=path, model_id=model_id)


@router.get(CHECKPOINT + "/external_weights_urls")
@needs("read")
def external_weights_urls(model_id: str, kind: str, name: str, caller: Key, request: Request, config: Config) -> dict:
    """A signed URL per file of the key's export (save_weights_external), valid SIGNED_URL_TTL_S: whoever holds
    one downloads that file, with no key, until then."""
    path = owned_checkpoint(request, caller, model_id, kind, name)
    if kind != "external_weights":
        raise ApiError(400, f"{path} is not an export; signed URLs are made for external_weights checkpoints",
                       field="path.checkpoint_id", hint="save_weights_external(name) makes one")
    key, base, urls, expires = url_key(request), f"{request.base_url}api/v1", {}, 0
    for file in store(request).checkpoint(caller.owner, path)["files"]:
        urls[file], expires = signing.signed_url(key, base, export_file(model_id, name, file), config.signed_url_ttl_s)
    audit.record(request, caller, "checkpoint_read", tinker_path=path, model_id=model_id, purpose="download_urls")
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}


def export_file(model_id: str, name: str, file: str) -> str:
    """The path (under /api/v1) of an export's file, as signed."""
    return f"external_weights/{quote(model_id, safe='')}/{name}/{file}"


@router.get("/external_weights/{model_id}/{name}/{file}", include_in_schema=False)
async def download_external_weights(model_id: str, name: str, file: str, expires: int, signature: str,
                                    request: Request, config: Config) -> StreamingResponse:
    """One file of an export, for the holder of its signed URL (no key: the URL is the credential); the file
    streams from the weight server. Refused (403) when the signature is not this URL's or it expired; 404 once
    the export is deleted or past its ttl."""
    await check_signed_url(request, export_file(model_id, name, file), expires, signature,
                           hint="ask get_external_weights_urls for fresh URLs")
    path = checkpoint_path(model_id, "external_weights", name)
    raw = await run_in_threadpool(request.app.state.redis.get, tinker_key("checkpoint", path))
    export = TinkerCheckpoint.model_validate_json(raw) if raw else None
    if export is None or not export.live(time.time()) or file not in export.files:
        raise ApiError(404, f"export {name} of {model_id} has no file {file} (deleted, or past its ttl)")
    await run_in_threadpool(audit.record, request, None, "checkpoint_read", export.owner, tinker_path=path,
                            model_id=model_id, purpose="download", file=file)
    http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, read=None))
    upstream = await http.send(http.build_request(
        "GET", f"{config.weight_server_url.rstrip('/')}/v1/exports/{export.run_id}/{name}/files/{file}"), stream=True)
    if upstream.status_code != 200:
        await upstream.aclose()
        await http.aclose()
        raise ApiError(502 if upstream.status_code >= 500 else 404,
                       f"the weight server answered {upstream.status_code} for {file} of export {name}")

    async def close() -> None:
        await upstream.aclose()
        await http.aclose()

    return StreamingResponse(upstream.aiter_raw(), media_type="application/octet-stream",
                             headers={"content-length": upstream.headers["content-length"]},
                             background=BackgroundTask(close))


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
    """A checkpoint (the key's own or a published one, of any kind) copied into a new model slot that cannot be
    trained on: `session_id` + `model_seq_id`, or a new session in `destination_project_id`. The copy shares the
    source's storage (a save_state's folder, an export, a version on the weight server), which the trainer's sweep
    keeps while either is live, and has its own expiry. A retry with the same X-Idempotency-Key is answered with
    the copy the first made."""
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
    session_id, seq = copy_slot(request, caller, body)
    model_id = training_model_id(session_id, seq)
    base = offered_model(config, source["base_model"])
    model = {"session_id": session_id, "run_id": None, "copy_of": body.source_path, "base_model": base.name,
             "source": base.source, "arch": base.arch, "lora": source["lora"], "optimizer_config": None,
             "user_metadata": {}}
    if not tinker.put_model(caller.owner, model_id, model, only_new=True):
        raise ApiError(400, f"model {model_id} exists already (model_seq_id {seq} is taken)", field="model_seq_id")
    tinker.file_under_session(session_id, "models", model_id)
    expires = time.time() + body.ttl_seconds if body.ttl_seconds else None
    path = tinker.put_copy(caller.owner, source, model_id, expires)
    audit.record(request, caller, "checkpoint_read", source["owner"], tinker_path=body.source_path,
                 model_id=parsed[0], purpose="copy", copy=path)
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
