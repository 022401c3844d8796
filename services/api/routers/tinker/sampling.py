"""Sampling: sampling sessions (of saved sampler weights or of a base model), samplers, asample, which puts
a sample request on the rollout workers' stream, and cancel_future, which withdraws one."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import Field
from sqlalchemy import select

from services.api.auth import needs
from services.api.deps import DB, Config
from services.api.errors import ApiError
from services.api.routers.tinker import audit
from services.api.routers.tinker.callers import Key, Wire, owned_session, store
from services.api.routers.tinker.sessions import offered_model
from services.api.routers.tinker.training import store_run
from services.api.tinker_base_models import OfferedModel
from shared.contracts.db.models import Run
from shared.contracts.messages import TinkerSample
from shared.contracts.messages.tinker import MAX_TOPK_LOGPROBS
from shared.contracts.streams import TINKER_SAMPLES
from shared.contracts.tinker_run import (
    CLIENT_SEQ_BLOCK,
    TinkerRunConfig,
    completion_queue,
    parse_checkpoint_path,
    sequence_id,
)
from shared.platform.bus import RedisError, announce, parse_stream_id

router = APIRouter()


class CreateSamplingSession(Wire):
    session_id: str
    sampling_session_seq_id: Annotated[int, Field(ge=0)]
    base_model: str | None = None
    model_path: str | None = None


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSession, caller: Key, request: Request, config: Config,
                            db: DB) -> dict:
    """A sampler of saved sampler weights (`model_path`: served by the model's run, its samples stored there, or,
    for another key's published weights, in a run of the caller's own) or of a base model (a run of its own, its
    samples stored as that run's episodes)."""
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
        run_owner = db.scalar(select(Run.config["owner"].astext).where(Run.id == uuid.UUID(saved["run_id"])))
        if run_owner != caller.owner:  # another key's weights (published, or a copy of them): the caller's samples
            record["store_run_id"] = sampler_run(request, caller, config, db, sampler_id, body.session_id,
                                                 offered_model(config, saved["base_model"]))
        audit.record(request, caller, "checkpoint_read", saved["owner"], tinker_path=body.model_path,
                     model_id=parsed[0], purpose="sample", sampling_session_id=sampler_id)
    elif body.base_model is not None:
        base = offered_model(config, body.base_model)
        record = {"run_id": sampler_run(request, caller, config, db, sampler_id, body.session_id, base),
                  "version": 0, "base_model": base.name, "model_path": None}
    else:
        raise ApiError(400, "give base_model or model_path", field="base_model")
    store(request).put_sampler(caller.owner, sampler_id, body.session_id, record)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


def sampler_run(request: Request, caller: Key, config, db, sampler_id: str, session_id: str,
                base: OfferedModel) -> str:
    """A run of the caller's for a sampling session's samples (kind `tinker`, no adapter of its own)."""
    run = TinkerRunConfig(name=f"tinker sampler {sampler_id}", model_id=sampler_id, session_id=session_id,
                          owner=caller.owner, owner_name=caller.principal.name, base_model=base.name,
                          model=base.source, lora=None, engine=config.tinker_engine)
    return store_run(request, caller, config, db, run)


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


class TensorWire(Wire):
    """The SDK's TensorData in JSON: flat `data`, its `shape`, CSR indices when sparse."""
    data: list[int | float]
    dtype: str
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


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
    target_prompt_logprobs: TensorWire | None = None
    prompt_alt_tokens_k: Annotated[int, Field(ge=0, le=MAX_TOPK_LOGPROBS)] = 0


DEFAULT_MAX_TOKENS = 256  # a sample request without max_tokens


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


def target_rows(tensor: TensorWire, prompt_length: int) -> list[list[int]]:
    """target_prompt_logprobs as dense rows of token ids (-1: none asked), checked: int64, [len(prompt) - 1, K]
    with K at most MAX_TOPK_LOGPROBS (the bound of a top-k width), at least one id, a consistent CSR layout."""
    field = "target_prompt_logprobs"
    rows = prompt_length - 1
    if tensor.dtype != "int64":
        raise ApiError(400, f"{field} must be an int64 tensor of token ids, not {tensor.dtype}", field=f"{field}.dtype")
    if not tensor.shape or len(tensor.shape) != 2 or tensor.shape[0] != rows or not 1 <= tensor.shape[1] <= \
            MAX_TOPK_LOGPROBS:
        raise ApiError(400, f"{field} has shape {tensor.shape}; this prompt of {prompt_length} tokens needs "
                       f"[{rows}, K] with 1 <= K <= {MAX_TOPK_LOGPROBS}", field=f"{field}.shape",
                       hint="row i scores prompt position i + 1; K ids per row at most, -1 where none is asked")
    width = tensor.shape[1]
    values = [int(v) for v in tensor.data]
    if (tensor.sparse_crow_indices is None) != (tensor.sparse_col_indices is None):
        raise ApiError(400, f"{field} gives one of sparse_crow_indices and sparse_col_indices without the other",
                       field=f"{field}.sparse_col_indices")
    if tensor.sparse_crow_indices is None:
        if len(values) != rows * width:
            raise ApiError(400, f"{field} has {len(values)} values for its shape {tensor.shape} ({rows * width})",
                           field=f"{field}.data")
        dense = [values[r * width:(r + 1) * width] for r in range(rows)]
    else:
        crow, cols = tensor.sparse_crow_indices, tensor.sparse_col_indices
        if (len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(values) or len(cols) != len(values)
                or any(a > b for a, b in zip(crow, crow[1:], strict=False))
                or any(not 0 <= c < width for c in cols)):
            raise ApiError(400, f"{field}'s CSR layout does not fit its shape {tensor.shape} and {len(values)} "
                           "values", field=f"{field}.sparse_crow_indices",
                           hint="build it with TensorData.from_torch_sparse(ids, pad_value=-1)")
        dense = [[-1] * width for _ in range(rows)]
        for r in range(rows):
            for j in range(crow[r], crow[r + 1]):
                dense[r][cols[j]] = values[j]
    if any(v < -1 for v in values) or all(v == -1 for v in values):
        raise ApiError(400, f"{field} must name at least one token id, and ids are >= 0 (-1 where none is asked)",
                       field=f"{field}.data")
    return dense


@router.post("/asample")
def asample(body: SampleRequest, caller: Key, request: Request) -> dict:
    if body.sampling_session_id is None:
        raise ApiError(400, "sample through a sampling session (the SDK's SamplingClient)", field="sampling_session_id")
    sampler = store(request).sampler(caller.owner, body.sampling_session_id)
    if sampler is None:
        raise ApiError(404, f"sampling session {body.sampling_session_id} does not exist", field="sampling_session_id")
    prompt = prompt_tokens(body.prompt)
    targets = None if body.target_prompt_logprobs is None else target_rows(body.target_prompt_logprobs, len(prompt))
    if body.prompt_alt_tokens_k and len(prompt) < 2:
        raise ApiError(400, "prompt_alt_tokens_k draws at the prompt positions after the first; this prompt has one "
                       "token", field="prompt_alt_tokens_k")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and (not (body.prompt_logprobs or body.topk_prompt_logprobs) or last_n >= len(prompt)):
        raise ApiError(400, f"prompt_logprobs_last_n {last_n} needs prompt logprobs asked for and a prompt longer "
                       f"than it (this prompt has {len(prompt)} tokens)", field="prompt_logprobs_last_n",
                       hint="between 1 and len(prompt) - 1, with prompt_logprobs or topk_prompt_logprobs")
    p = body.sampling_params
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    try:
        request_id = store(request).pending(caller.owner, None, sampler["session_id"], "sample",
                                            body.sampling_session_id)
        sequence_ids = [sequence_id(request_id, i) for i in range(body.num_samples)]
        announce(request.app.state.redis, TINKER_SAMPLES, TinkerSample(
            request_id=request_id, owner=caller.owner, run_id=sampler["run_id"], version=sampler["version"],
            store_run_id=sampler.get("store_run_id"),
            sequence_ids=sequence_ids, prompt=prompt, num_samples=body.num_samples,
            max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            stop_strings=[x for x in stop if isinstance(x, str)], stop_tokens=[x for x in stop if isinstance(x, int)],
            prompt_logprobs=bool(body.prompt_logprobs), prompt_logprobs_last_n=last_n,
            topk_prompt_logprobs=body.topk_prompt_logprobs, topk_sample_logprobs=body.topk_sample_logprobs,
            target_prompt_ids=targets, target_sparse=bool(body.target_prompt_logprobs
                                                          and body.target_prompt_logprobs.sparse_crow_indices),
            prompt_alt_tokens_k=body.prompt_alt_tokens_k, seed=p.seed, completions=completion_queue(body.sampling_session_id, body.seq_id or 0),
            sent_at=time.time(), session_id=sampler["session_id"], base_model=sampler["base_model"]))
    except RedisError as e:
        raise ApiError(503, f"Redis is unreachable, so the sample could not be sent to a rollout worker ({e})",
                       hint="retry once Redis is back") from e
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}


class FuturesTarget(Wire):
    sampling_session_id: str
    cloned_sampler_id: Annotated[int, Field(ge=0)] = 0


class RetrieveFutures(Wire):
    target: FuturesTarget
    prev_cursor: Annotated[int, Field(ge=0)] = 0
    timeout: Annotated[float, Field(ge=0)] | None = None
    retrieved_request_ids: list[str] = []


LONG_POLL_S = 30.0  # a retrieve_futures poll without a timeout waits this long at most (the SDK's HTTP timeout: 45)
POLL_EVERY_S = 0.1  # how often a waiting poll looks at its queue


def stream_id(cursor: int) -> str:
    """The Redis stream id behind a cursor: the SDK's cursor is an int, a stream id is `<ms>-<seq>`."""
    return f"{cursor // 1_000_000}-{cursor % 1_000_000}"


def text(fields: dict, name: str) -> str:
    value = fields.get(name.encode(), fields.get(name))
    return value.decode() if isinstance(value, bytes) else value


def cursor_of(entry_id: bytes | str) -> int:
    ms, seq = parse_stream_id(entry_id)
    return ms * 1_000_000 + seq


@router.post("/retrieve_futures")
@needs("read")  # as retrieve_future: reading answers
async def retrieve_futures(body: RetrieveFutures, caller: Key, request: Request) -> dict:
    """The completion queue of one sampling client: the requests answered since `prev_cursor` (what came
    before it is trimmed, being seen), waiting up to `timeout` (LONG_POLL_S when none) for the first. The SDK
    then fetches each answer with retrieve_future."""
    redis = request.app.state.redis
    target = body.target
    if await run_in_threadpool(store(request).sampler, caller.owner, target.sampling_session_id) is None:
        raise ApiError(404, f"sampling session {target.sampling_session_id} does not exist",
                       field="target.sampling_session_id")
    queue = completion_queue(target.sampling_session_id, target.cloned_sampler_id * CLIENT_SEQ_BLOCK)
    after = stream_id(body.prev_cursor)
    if body.prev_cursor:
        await run_in_threadpool(redis.xtrim, queue, minid=stream_id(body.prev_cursor + 1))
    deadline = time.monotonic() + (LONG_POLL_S if body.timeout is None else min(body.timeout, LONG_POLL_S))
    while True:
        read = await run_in_threadpool(redis.xread, {queue: after}, 1000)
        entries = read[0][1] if read else []
        if entries or time.monotonic() >= deadline or await request.is_disconnected():
            break
        await asyncio.sleep(POLL_EVERY_S)
    completions = [{"state": text(fields, "state"), "request_id": text(fields, "request_id")} for _, fields in entries]
    return {"completions": completions, "cursor": cursor_of(entries[-1][0]) if entries else body.prev_cursor}


class JoinSamplingSession(Wire):
    sampling_session_id: str


@router.post("/join_sampling_session")
def join_sampling_session(body: JoinSamplingSession, caller: Key, request: Request) -> dict:
    """A copy of a SamplingClient (one unpickled in another process) joins its sampling session before its first
    sample: the number it gets, unique among the session's clients, keeps its requests' seq_ids apart from
    theirs."""
    if store(request).sampler(caller.owner, body.sampling_session_id) is None:
        raise ApiError(404, f"sampling session {body.sampling_session_id} does not exist",
                       field="sampling_session_id")
    return {"type": "join_sampling_session", "client_counter": store(request).join_sampler(body.sampling_session_id)}


class CancelFuture(Wire):
    request_id: str


CANCELLED = {"error": "the client cancelled this sample (cancel_future)", "category": "user"}


@router.post("/cancel_future")
def cancel_future(body: CancelFuture, caller: Key, request: Request) -> None:
    """Withdraw a sample request the client abandoned (the SDK sends this when a sample's future is cancelled or
    times out): its future answers that it was cancelled, and the rollout worker serving it drops it, before or
    while generating. A future already answered keeps its answer; a training operation is not withdrawn (the
    trainer applies a model's operations in order)."""
    try:
        future = store(request).cancel_sample(caller.owner, body.request_id, CANCELLED)
    except RedisError as e:
        raise ApiError(503, f"Redis is unreachable, so the sample could not be cancelled ({e})",
                       hint="retry once Redis is back") from e
    if future is None:
        raise ApiError(404, f"future {body.request_id} does not exist (or has expired)", field="request_id")
    if future["model_id"] is not None:
        raise ApiError(400, f"future {body.request_id} is a training operation; only samples are cancelled",
                       field="request_id")
