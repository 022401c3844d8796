"""Tinker samples on the rollout workers: `tinker.samples` (group `rollout`). Each request is served by the
engine of its run (a training model's adapter at the version its sampler checkpoint named, an older one beside
the newest, or a base model's),
its samples go to `trajectories` (stored as the run's episodes: SQL works over Tinker work), then the answer
goes into the request's future. A request its client cancelled (`cancel_future`) is dropped, before or while it
is generated; one dead-lettered is answered with the reason. More: docs/tinker.md#sampling
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from prometheus_client import Counter

from services.rollout_worker.engines import Generation, SamplingParams, UnservedRequest
from services.rollout_worker.run_engines import RunContext
from shared.contracts.messages import EpisodeResult, TinkerFuture, TinkerSample, TrajectoryRecord
from shared.contracts.messages.trajectory import TrajectoryStep
from shared.contracts.streams import GROUP_ROLLOUT, TINKER_SAMPLES, TRAJECTORIES, tinker_key
from shared.contracts.tinker_run import COMPLETIONS_MAXLEN, FUTURE_TTL_S
from shared.platform.bus import RedisError, StreamConsumer
from shared.platform.logs import get_logger
from shared.sdk.types import TerminationReason
from shared.stores.tinker_usage import count_once

log = get_logger(__name__)
VERSION_WAIT_S = 60.0  # how long a request waits for its sampler weights to reach this worker
CANCEL_POLL_S = 0.5  # how often a request being served looks for its client's cancel
CANCELLED = Counter("rollout_tinker_samples_cancelled_total", "Tinker sample requests dropped: their client "
                    "cancelled them (cancel_future)", ["when"])
T = TypeVar("T")


class SampleRefused(Exception):
    """A request this worker cannot serve as asked (the client's to change): answered, not retried."""


class SampleCancelled(Exception):
    """The request's client cancelled it: the API has answered its future; nothing more is done for it."""

    def __init__(self, request_id: str, started: bool):
        super().__init__(request_id)
        self.started = started


async def unless_cancelled(redis, request_id: str, work: Callable[[], Awaitable[T]],
                           poll_s: float = CANCEL_POLL_S) -> T:
    """`work()`'s result, unless the request's client cancels it first: then SampleCancelled, and the work is
    cancelled (vLLM aborts the request; the hf engine drops it unless its batch has started). A cancel already
    made when this is called means the work never starts. While Redis cannot be read the work goes on."""
    key = tinker_key("cancelled", request_id)

    async def cancelled() -> bool:
        try:
            return bool(await redis.exists(key))
        except RedisError:
            return False

    if await cancelled():
        raise SampleCancelled(request_id, started=False)
    task = asyncio.ensure_future(work())
    try:
        while not (await asyncio.wait({task}, timeout=poll_s))[0]:
            if await cancelled():
                raise SampleCancelled(request_id, started=True)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def cut_at_stop_tokens(ids: list[int], logprobs: list[float], stop: list[int]) -> tuple[list[int], list[float], bool]:
    """The generation up to and including its first stop token; whether one was found."""
    for i, token in enumerate(ids):
        if token in stop:
            return ids[:i + 1], logprobs[:i + 1], True
    return ids, logprobs, False


def sample_params(msg: TinkerSample, i: int) -> SamplingParams:
    """Sample i's engine request: seeded with seed + i when the request has a seed; the first sample's also
    scores the prompt (logprobs, target logprobs, alt tokens), when that was asked."""
    first = i == 0
    return SamplingParams(temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, stop=tuple(msg.stop_strings),
                          logprobs=msg.topk_sample_logprobs, seed=None if msg.seed is None else msg.seed + i,
                          prompt_logprobs=msg.topk_prompt_logprobs if first and (
                              msg.prompt_logprobs or msg.topk_prompt_logprobs) else None,
                          prompt_targets=tuple(map(tuple, msg.target_prompt_ids))
                          if first and msg.target_prompt_ids else None,
                          prompt_alt_k=msg.prompt_alt_tokens_k if first else 0)


def prompt_scores(msg: TinkerSample, gen: Generation) -> dict:
    """What the request asked of its prompt, from the generation that scored it: each position's logprob and/or
    its k likeliest tokens, None where not scored (the first token, and those before the last
    `prompt_logprobs_last_n`); the target ids' logprobs (rows of the request's shape; a cell it did not ask for
    is 0.0, or None when its tensor was sparse, so that it is left out again); the alt tokens drawn."""
    skip = len(msg.prompt) - msg.prompt_logprobs_last_n if msg.prompt_logprobs_last_n else 0
    scores = {}
    if msg.prompt_logprobs:
        scores["prompt_logprobs"] = [None if i < skip else v for i, v in enumerate(gen.prompt_logprobs)]
    if msg.topk_prompt_logprobs:
        scores["topk_prompt_logprobs"] = [None if i < skip else v for i, v in enumerate(gen.prompt_top_logprobs)]
    if msg.target_prompt_ids:
        unasked = None if msg.target_sparse else 0.0
        scores["target_prompt_logprobs"] = [
            [unasked if t < 0 else v for t, v in zip(ids, values, strict=True)]
            for ids, values in zip(msg.target_prompt_ids, gen.prompt_target_logprobs, strict=True)]
        if msg.target_sparse:
            scores["target_sparse"] = True
    if msg.prompt_alt_tokens_k:
        scores["prompt_alt_tokens"] = gen.prompt_alt_tokens
    return scores


class TinkerSampling:
    def __init__(self, worker):
        self.worker = worker
        cfg = worker.cfg
        self.consumer = StreamConsumer(worker.bus, TINKER_SAMPLES, GROUP_ROLLOUT, worker.worker_id,
                                       expect=TinkerSample, max_deliveries=cfg.max_deliveries,
                                       claim_idle_ms=cfg.claim_idle_ms, block_ms=cfg.read_block_ms,
                                       batch_size=cfg.max_concurrency, on_dead_letter=self.dead_lettered)
        self.running: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.consumer.start()

    async def loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if len(self.running) >= self.worker.cfg.max_concurrency:
                await asyncio.wait(list(self.running), timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                continue
            for d in await self.consumer.read():
                task = asyncio.create_task(self.serve(d))
                self.running.add(task)
                task.add_done_callback(self.running.discard)
        for task in list(self.running):
            task.cancel()

    async def serve(self, delivery) -> None:
        msg: TinkerSample = delivery.message
        started = time.time()
        try:
            gens = await unless_cancelled(self.worker.bus.redis, msg.request_id, lambda: self.generate(msg))
            sequences, results = [], []
            for i, g in enumerate(gens):
                ids, logprobs, stopped = cut_at_stop_tokens(g.ids, g.logprobs, msg.stop_tokens)
                reason = "stop" if stopped or g.finish_reason == "stop" else "length"
                sequences.append({"tokens": ids, "logprobs": logprobs, "stop_reason": reason})
                if msg.topk_sample_logprobs:
                    sequences[-1]["topk"] = g.top_logprobs[:len(ids)]
                results.append(self.episode(msg, i, ids, logprobs, reason, g.weight_version, started))
            # stored first: an answered sample is on `trajectories` (the store keeps it once)
            await self.worker.bus.publish_many(TRAJECTORIES, results)
            # the prompt tokens cached before this request: the samples' prefills run together, and each found
            # at least those (one that ran after another found the whole prompt)
            cached = min(g.cached_prompt_tokens for g in gens)
            answer = {"type": "sample", "sequences": sequences, "prompt_cache_hit_tokens": cached,
                      **prompt_scores(msg, gens[0])}
        except SampleCancelled as e:
            CANCELLED.labels("during" if e.started else "before").inc()
            log.info("tinker sample %s cancelled by its client", msg.request_id, extra={"run_id": msg.run_id})
            await self.consumer.ack([delivery])
            return
        except (SampleRefused, UnservedRequest) as e:
            answer = {"error": str(e), "category": "user"}
        except Exception as e:  # an engine or a run that cannot serve: the client learns why, the worker goes on
            log.exception("tinker sample of run %s failed", msg.run_id, extra={"run_id": msg.run_id})
            answer = {"error": f"sampling failed on rollout worker {self.worker.worker_id}: {e!r}",
                      "category": "server"}
        await self.answer(msg, answer)
        await self.consumer.ack([delivery])

    async def answer(self, msg: TinkerSample, answer: dict) -> None:
        """The request's future, its announcement on the client's completion queue and its usage, together."""
        record = TinkerFuture(owner=msg.owner, model_id=None, result=answer, answered_at=time.time())
        pipe = self.worker.bus.redis.pipeline(transaction=True)
        pipe.set(tinker_key("future", msg.request_id), record.model_dump_json(), ex=FUTURE_TTL_S)
        if "error" not in answer:  # the prompt prefilled once for all its samples, its cached part told apart
            cached = answer.get("prompt_cache_hit_tokens", 0)
            count_once(pipe, msg.owner, msg.request_id, msg.session_id, msg.base_model,
                       {"sampling_prefill": len(msg.prompt) - cached, "sampling_prefill_cached": cached,
                        "sampling_sample": sum(len(q["tokens"]) for q in answer["sequences"])}, record.answered_at)
        if msg.completions:
            state = "failed" if "error" in answer else "finished"
            pipe.xadd(msg.completions, {"request_id": msg.request_id, "state": state}, maxlen=COMPLETIONS_MAXLEN,
                      approximate=True)
            pipe.expire(msg.completions, FUTURE_TTL_S)
        await pipe.execute()

    async def dead_lettered(self, delivery, entry_id: bytes, reason: str) -> None:
        """A request dead-lettered (workers died serving it, MAX_DELIVERIES times: a request that crashes its
        worker) is answered with the reason, so its client's future fails instead of waiting for ever."""
        if delivery is None:  # undecodable: no request to answer (the API sends none such)
            return
        msg: TinkerSample = delivery.message
        log.error("tinker sample %s dead-lettered: %s", msg.request_id, reason, extra={"run_id": msg.run_id})
        await self.answer(msg, {"error": f"the sample request could not be served and was given up: {reason} "
                                         "(a request that stops the rollout worker serving it, such as one too "
                                         "large for its memory, is dead-lettered after MAX_DELIVERIES tries)",
                                "category": "server"})

    async def generate(self, msg: TinkerSample) -> list[Generation]:
        ctx = await self.worker.runs.get(msg.run_id)
        with ctx.in_use():  # the run (and so its older versions) is not released while a request waits on it
            served = await self.at_version(ctx, msg.version)
            with served.in_use():
                return await asyncio.gather(*(served.engine.generate(msg.prompt, sample_params(msg, i),
                                                                     msg.max_tokens)
                                              for i in range(msg.num_samples)))

    async def at_version(self, ctx: RunContext, version: int) -> RunContext:
        """The run at `version` of its weights: waited for while it has not arrived (announced on `weights`); an
        adapter of its own when the run has moved past it (a sampler of a model's earlier sampler weights)."""
        if ctx.engine.version < version:
            await self.worker.runs.load_newest(ctx)
        deadline = time.monotonic() + VERSION_WAIT_S
        while ctx.engine.version < version and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if ctx.engine.version == version:
            return ctx
        if ctx.engine.version < version:
            raise SampleRefused(f"the sampler weights asked for are version {version} of run {ctx.run_id}; it has "
                                f"not reached this worker in {VERSION_WAIT_S:.0f}s (it serves version "
                                f"{ctx.engine.version})")
        try:
            return await self.worker.runs.older_version(ctx, version)
        except (LookupError, ValueError) as e:
            raise SampleRefused(f"the sampler weights asked for cannot be served: {e}; sample from a newer "
                                "save_weights_for_sampler") from e

    def episode(self, msg: TinkerSample, i: int, ids: list[int], logprobs: list[float], reason: str, version: int,
                started: float) -> EpisodeResult:
        """One sample as the run's episode: task id = the request, sample_idx = its index, the sequence id in
        `info` (what the SDK returned as sample_sequence_ids)."""
        termination = TerminationReason.ENV_DONE if reason == "stop" else TerminationReason.RESPONSE_TRUNCATION
        step = TrajectoryStep(prompt_ids=msg.prompt, response_ids=ids, logprobs=logprobs, weight_version=version,
                              done=True, info={"stop_reason": reason})
        traj = TrajectoryRecord(uid=uuid.uuid4().hex, name="tinker_sample", termination_reason=termination,
                                steps=[step], prompt_ids=msg.prompt, response_ids=ids, logprobs=logprobs,
                                loss_mask=[1] * len(ids), versions=[version] * len(ids))
        return EpisodeResult(run_id=msg.store_run_id or msg.run_id, task_id=msg.request_id, sample_idx=i, status="completed",
                             termination_reason=termination, trajectories=[traj], worker_id=self.worker.worker_id,
                             info={"sequence_id": msg.sequence_ids[i], "tinker": True}, started_at=started,
                             finished_at=time.time())
