"""Training: LoRA training models (create_model, get_info, each with its run of kind `tinker`), their operations
(forward_backward, optim_step, save, load: sent to the trainer on `tinker.ops.<model id>`) and the futures the
operations return (retrieve_future)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from google.protobuf.message import DecodeError
from pydantic import Field, ValidationError

from services.api.auth import needs
from services.api.deps import DB, Config
from services.api.errors import ApiError
from services.api.routers.runs import commanding
from services.api.routers.tinker import audit
from services.api.routers.tinker.callers import Caller, Key, Wire, owned_model, owned_session, store
from services.api.routers.tinker.checkpoints import MAX_TTL_S
from services.api.routers.tinker.provenance import recorded_samples, with_recorded_logprobs
from services.api.routers.tinker.sessions import offered_model
from services.api.tinker_proto import (
    ForwardBackwardRequest,
    WireError,
    decode_datums,
    encode_output,
    encode_samples,
    sampled_spans,
)
from shared.clients.run_commands import run_command
from shared.contracts.messages import TinkerOp, TinkerWake
from shared.contracts.messages.tinker import AdamStep
from shared.contracts.streams import TINKER_REQUESTS, tinker_model_ops
from shared.contracts.tinker_run import (
    LOSS_CONFIG,
    LOSS_INPUTS,
    MAX_AGE_RECIPIENTS,
    MODEL_TTL_S,
    SAMPLED_LOSSES,
    TinkerRunConfig,
    checkpoint_name_ok,
    checkpoint_path,
    parse_checkpoint_path,
    training_model_id,
)
from shared.platform.bus import RedisError, announce
from shared.weights.age import age_recipient

router = APIRouter()


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


@router.post("/create_model")
def create_model(body: CreateModel, caller: Key, request: Request, config: Config, db: DB) -> dict:
    if body.lora_config is None:
        raise ApiError(400, "only LoRA training models are served: give a lora_config", field="lora_config")
    model_id = new_model(request, caller, config, db, body.session_id, body.model_seq_id, body.base_model,
                         body.lora_config.model_dump(), body.optimizer_config, body.user_metadata)
    request_id = store(request).complete(caller.owner, {"type": "create_model", "model_id": model_id}, model_id)
    return {"request_id": request_id, "model_id": model_id}


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
    model_id = training_model_id(session_id, model_seq_id)
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


def send_op(request: Request, caller: Caller, model: dict, **op) -> dict:
    """Store the operation's future (`try_again`), put the operation on its model's stream (where the trainer
    holding the model reads it, in order), then wake the trainers (one takes the model if none holds it); the
    SDK's future answer."""
    tinker, redis, model_id = store(request), request.app.state.redis, op["model_id"]
    try:
        request_id = tinker.pending(caller.owner, model_id, model["session_id"], op["op"], model_id)
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
async def forward_backward(request: Request, caller: Key, db: DB) -> dict:
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
    return await run_in_threadpool(_forward_backward, request, caller, msg, db)


def _forward_backward(request: Request, caller: Caller, msg, db) -> dict:
    model = owned_model(request, caller, msg.model_id)
    if msg.loss_fn not in LOSS_INPUTS:
        raise ApiError(400, f"loss {msg.loss_fn!r} is not served", field="forward_backward_input.loss_fn",
                       hint=f"served losses: {', '.join(LOSS_INPUTS)}")
    if not msg.data:
        raise ApiError(400, "no datums", field="forward_backward_input.data")
    try:
        data = decode_datums(msg, LOSS_INPUTS)
        spans = sampled_spans(msg, data) if msg.loss_fn in SAMPLED_LOSSES else None
    except WireError as e:
        raise ApiError(400, e.message, field=e.field, hint=e.hint) from e
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
    config = config or dict(msg.loss_fn_config)
    known = LOSS_CONFIG.get(msg.loss_fn, {})
    for key in [k for k in config if k not in known] + [k for k, v in known.items() if v is None and k not in config]:
        raise ApiError(400, f"loss {msg.loss_fn!r} {'has no' if key in config else 'needs the'} loss_fn_config "
                       f"{key!r}", field=f"forward_backward_input.loss_fn_config.{key}",
                       hint=f"its config: {', '.join(known) or 'none'}")
    if spans is not None:  # trained against what the sampler recorded
        recorded = recorded_samples(db, store(request), caller.owner, {s.sequence_id for runs in spans for s in runs})
        data = with_recorded_logprobs(data, spans, recorded)
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


class SaveWeightsExternal(SaveWeights):
    path: str  # the export's name
    age_encryption_recipients: Annotated[list[str], Field(max_length=MAX_AGE_RECIPIENTS)] | None = None


KIND_OF_SAVE = {"save_weights": "weights", "save_weights_for_sampler": "sampler_weights",
                "save_weights_external": "external_weights"}


def _save(body: SaveWeights, caller: Caller, request: Request, op: str, **extra) -> dict:
    model = owned_model(request, caller, body.model_id)
    seq_id = body.seq_id or 0
    name = body.path or (f"sampler-{seq_id:06d}" if op == "save_weights_for_sampler" else f"{seq_id:06d}")
    if not checkpoint_name_ok(name):
        raise ApiError(400, f"checkpoint name {name!r} is not 1-128 letters, digits, '.', '_' or '-' (not starting "
                       "with '.')", field="path")
    kind = KIND_OF_SAVE[op]
    if not body.overwrite and store(request).checkpoint(caller.owner, checkpoint_path(body.model_id, kind, name)):
        # 400, not 409: the SDK retries a 409 as a lock timeout, and this will not change
        raise ApiError(400, f"checkpoint {checkpoint_path(body.model_id, kind, name)} exists already", field="path",
                       hint="save under another name, or " + ("delete it first" if op == "save_weights_external"
                                                              else "pass overwrite=True to replace it"))
    store(request).publish(checkpoint_path(body.model_id, kind, name), False)  # a checkpoint saved starts private
    sampler_id = None
    if op == "save_weights_for_sampler" and body.sampling_session_seq_id is not None:
        # the trainer publishes these weights as version seq_id of the model's run: the sampler serves that
        sampler_id = f"{model['session_id']}:sample:{body.sampling_session_seq_id}"
        store(request).put_sampler(caller.owner, sampler_id, model["session_id"], {
            "run_id": model["run_id"], "version": seq_id, "base_model": model["base_model"],
            "model_path": checkpoint_path(body.model_id, "sampler_weights", name)})
    return send_op(request, caller, model, model_id=body.model_id, seq_id=seq_id, op=op, name=name,
                   sampling_session_id=sampler_id, ttl_s=body.ttl_seconds,
                   user_metadata=body.user_metadata or {}, **extra)


@router.post("/save_weights")
def save_weights(body: SaveWeights, caller: Key, request: Request) -> dict:
    """save_state: adapter and Adam state, tinker://<model>/weights/<name>."""
    return _save(body, caller, request, "save_weights")


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeights, caller: Key, request: Request) -> dict:
    """The adapter for sampling, tinker://<model>/sampler_weights/<name> (a version on the weight server)."""
    return _save(body, caller, request, "save_weights_for_sampler")


@router.post("/save_weights_external")
def save_weights_external(body: SaveWeightsExternal, caller: Key, request: Request) -> dict:
    """The adapter in PEFT's layout, tinker://<model>/external_weights/<name> (an export on the weight server,
    downloaded through get_external_weights_urls), each file encrypted to the age recipients given."""
    recipients = body.age_encryption_recipients or []
    for i, text in enumerate(recipients):
        try:
            age_recipient(text)
        except ValueError as e:
            raise ApiError(400, str(e), field=f"age_encryption_recipients.{i}",
                           hint="an age public key (age-keygen -y) or an SSH public key line") from None
    return _save(body, caller, request, "save_weights_external", age_recipients=recipients)


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
    future = send_op(request, caller, model, model_id=model_id, seq_id=seq_id, op="load_weights", path=body.path,
                     optimizer=body.optimizer)
    audit.record(request, caller, "checkpoint_read", saved["owner"], tinker_path=body.path, model_id=parsed[0],
                 purpose="load_state_with_optimizer" if body.optimizer else "load_state", into=model_id)
    return future
