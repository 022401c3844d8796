"""Per-run state a worker builds once: the RunConfig from Postgres, tokenizer, engine, agent/workflow classes;
and hot reload of the run's weights (newest checkpoint in Postgres at first use, then the `weights` stream).
A delta version is applied in place when the engine supports it and serves the delta's base; otherwise (behind,
joined late, engine without in-place update, or a delta that does not verify) the worker loads the full
weights: the snapshot, or the nearest snapshot before it with the deltas since applied and verified.

LoRA runs (`algorithm.lora`) naming the same model (and engine settings) share one engine: one copy of the base,
each run through an `AdapterView` with its own adapter (versions are adapters, the manifest naming the base; one
of another base is refused), and an older version asked for (a Tinker sampler of a model's earlier sampler
weights) through an adapter of its own beside the newest (`older_version`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from services.rollout_worker.assembly import ChatTokenizer
from services.rollout_worker.engines import AdapterView, InferenceEngine, SamplingParams, build_engine
from services.rollout_worker.weight_relay import Relay
from shared.contracts.db.models import Checkpoint, Run
from shared.contracts.messages import WeightsPublished
from shared.contracts.registry import resolve
from shared.contracts.run_config import EngineConfig, RunConfig
from shared.contracts.tinker_run import TinkerRunConfig
from shared.platform.logs import get_logger
from shared.weights.delta import WeightUpdate
from shared.weights.fetch import fetch_checkpoint, fetch_manifest, materialize, version_source
from shared.weights.manifest import CheckpointManifest, ChecksumError

log = get_logger(__name__)
WEIGHT_VERSION = Gauge("rollout_weight_version", "Policy version served", ["run_id"])
RELOADS = Counter("rollout_weight_reloads_total", "Weight reloads", ["outcome"])
# served="no": an announcement for a run this worker holds no engine for (never served, or ended and released)
ANNOUNCEMENTS = Counter("rollout_weight_announcements_total", "Weight announcements read from the stream",
                        ["served"])


class RunNotFound(ValueError):
    pass


class RunUnavailable(RuntimeError):
    """The run's context could not be built a moment ago: its next tasks fail at once with the same reason (so the
    controller's fail-fast sees one reason again and again) instead of each retrying the loader."""


OLDER_VERSIONS_MAX = 8  # older adapter versions a worker keeps loaded (least recently used dropped first)
BUILD_FAILURE_HOLD_S = 30.0  # how long a failed build answers for the run before it is tried again
ENDED = ("stopped", "failed", "completed")  # a run in one of these has no work left on any worker


async def in_daemon_thread(fn, *args):
    """`asyncio.to_thread` in a daemon thread of its own: for loaders that can block for minutes (a hub that
    does not answer, retried by huggingface_hub). Cancelled, the caller goes on; the thread cannot be stopped,
    but the process exits without waiting for it (to_thread's pool is joined at exit: a worker that would not
    stop within its grace period)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result, error):
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def work():
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, daemon=True, name=f"load-{getattr(fn, '__name__', 'fn')}").start()
    return await done


@dataclass
class RunContext:
    run_id: str
    config: RunConfig | TinkerRunConfig  # a Tinker run's: its samples only (no agent, env or workflow)
    chat: ChatTokenizer
    engine: InferenceEngine
    agent_cls: Any
    workflow_cls: Any | None
    reload_lock: asyncio.Lock
    running: int = 0  # tasks of this run in progress on this worker
    last_used: float = 0.0  # monotonic time a task of this run last started or ended here

    @contextlib.contextmanager
    def in_use(self):
        """Around one task of this run: the context is not evicted while any task runs."""
        self.running += 1
        try:
            yield self
        finally:
            self.running -= 1
            self.last_used = time.monotonic()

    def sampling(self, greedy: bool) -> SamplingParams:
        s = self.config.sampling
        partial = self.config.partial_rollout
        if greedy:  # ReMax baseline / evaluation: deterministic decoding
            return SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, stop=tuple(s.stop), partial=partial)
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, stop=tuple(s.stop),
                              partial=partial)


class RunRegistry:
    def __init__(self, db: Engine, weights_cache: Path, hf_batch_wait_ms: float, relay: Relay | None = None):
        self.db, self.relay = db, relay  # relay: fetch checkpoint files through the relay chain
        self.weights_cache = weights_cache
        self.hf_batch_wait_ms = hf_batch_wait_ms
        self.contexts: dict[str, RunContext] = {}
        self.bases: dict[tuple, InferenceEngine] = {}  # (model, engine settings) -> the engine LoRA runs share
        self._bases_lock = asyncio.Lock()  # two LoRA runs starting at once build one base
        self.announced: dict[str, WeightsPublished] = {}  # newest seen on the stream, served or not
        self._locks: dict[str, asyncio.Lock] = {}
        self._manifests: dict[str, CheckpointManifest] = {}  # sha256 -> verified manifest
        self._manifests_lock = threading.Lock()
        self.failed: dict[str, tuple[float, str]] = {}  # run -> (monotonic time, why) of its last failed build
        self.older: dict[tuple[str, int], RunContext] = {}  # (LoRA run, older version) -> its own adapter, by use
        self._older_lock = asyncio.Lock()

    async def get(self, run_id: str) -> RunContext:
        if run_id not in self.contexts:
            async with self._locks.setdefault(run_id, asyncio.Lock()):
                if (failed := self.failed.get(run_id)) and time.monotonic() - failed[0] < BUILD_FAILURE_HOLD_S:
                    raise RunUnavailable(failed[1])
                if run_id not in self.contexts:
                    try:
                        ctx = await self.build(run_id)
                        await self.load_newest(ctx)
                    except Exception as e:
                        self.failed[run_id] = (time.monotonic(), f"{type(e).__name__}: {e}")
                        raise RunUnavailable(self.failed[run_id][1]) from e
                    self.failed.pop(run_id, None)
                    self.contexts[run_id] = ctx
        ctx = self.contexts[run_id]
        ctx.last_used = time.monotonic()
        return ctx

    async def evict_idle(self, idle_s: float) -> list[str]:
        """Release the engines of runs with no task here for `idle_s` (a long-lived worker serves many runs in
        turn; each context can hold a model). A task of such a run that comes back builds it again, loading the
        newest checkpoint."""
        now = time.monotonic()
        for key, older in list(self.older.items()):
            if older.running == 0 and now - older.last_used > idle_s:
                await self._drop_older(key)
        idle = [c for c in self.contexts.values()
                if c.running == 0 and now - c.last_used > idle_s and not c.reload_lock.locked()]
        for ctx in idle:
            del self.contexts[ctx.run_id]
            self._locks.pop(ctx.run_id, None)
            with contextlib.suppress(KeyError):  # never labelled if it failed before serving
                WEIGHT_VERSION.remove(ctx.run_id)
            try:
                await ctx.engine.close()
                for key in [k for k in self.older if k[0] == ctx.run_id]:
                    await self._drop_older(key)
                await self._close_unused_bases()
            except Exception:
                log.warning("closing the engine of run %s failed", ctx.run_id, exc_info=True)
            log.info("released run %s after %.0fs without tasks", ctx.run_id, now - ctx.last_used,
                     extra={"run_id": ctx.run_id})
        return [c.run_id for c in idle]

    async def build(self, run_id: str) -> RunContext:
        from shared.weights.kernels import warm_up_in_background

        warm_up_in_background()  # compiled before the run's first delta, not on its clock
        config = await asyncio.to_thread(self.load_config, run_id)
        from transformers import AutoTokenizer

        if isinstance(config, TinkerRunConfig):
            tokenizer = await in_daemon_thread(AutoTokenizer.from_pretrained, config.model)
            engine = await self._engine(run_id, config.model, config.engine, config.lora is not None, tokenizer)
            log.info("serving the samples of tinker run %s: model %s", run_id, config.model, extra={"run_id": run_id})
            return RunContext(run_id, config, ChatTokenizer(tokenizer), engine, None, None, asyncio.Lock())
        tokenizer = await in_daemon_thread(AutoTokenizer.from_pretrained, config.tokenizer_path)
        engine = await self._engine(run_id, config.model, config.engine, config.algorithm.lora is not None, tokenizer)
        workflow_cls = resolve("workflow", config.workflow.name) if config.workflow else None
        log.info("serving run %s: model %s, engine %s", run_id, config.model, config.engine.type,
                 extra={"run_id": run_id})
        return RunContext(run_id, config, ChatTokenizer(tokenizer), engine, resolve("agent", config.agent.name),
                          workflow_cls, asyncio.Lock())

    async def _engine(self, run_id: str, model: str, engine: EngineConfig, lora: bool, tokenizer) -> InferenceEngine:
        """The run's engine; a LoRA run's is a view of the engine every LoRA run of its model shares."""
        kwargs: dict = {"hf": {"batch_wait_ms": self.hf_batch_wait_ms},
                        # a delta's layers go to the server as a file: where it reads full checkpoints from too
                        "openai": {"scratch_dir": self.weights_cache / ".deltas"}}.get(engine.type, {})
        if not lora:
            return await in_daemon_thread(functools.partial(build_engine, engine.type, model, engine, tokenizer,
                                                            **kwargs))
        if engine.type == "vllm":
            kwargs["lora"] = True  # vLLM reserves its adapter slots at start-up
        key = (model, engine.model_dump_json())
        async with self._bases_lock:
            if key not in self.bases:
                self.bases[key] = await in_daemon_thread(
                    functools.partial(build_engine, engine.type, model, engine, tokenizer, **kwargs))
        return AdapterView(self.bases[key], run_id)

    def ended(self, run_ids: set[str]) -> set[str]:
        """Those of `run_ids` that have ended (stopped, failed, completed) or no longer exist (deleted)."""
        with self.db.connect() as conn:
            rows = conn.execute(select(Run.id, Run.status).where(Run.id.in_([uuid.UUID(r) for r in run_ids])))
            live = {str(i) for i, status in rows if status not in ENDED}
        return run_ids - live

    async def forget(self, run_id: str) -> None:
        """Release what this worker holds for an ended run (its engine, its failed build)."""
        self.failed.pop(run_id, None)
        ctx = self.contexts.get(run_id)
        if ctx is not None and not ctx.reload_lock.locked():
            del self.contexts[run_id]
            self._locks.pop(run_id, None)
            with contextlib.suppress(KeyError):
                WEIGHT_VERSION.remove(run_id)
            await ctx.engine.close()
        for key in [k for k in self.older if k[0] == run_id]:
            await self._drop_older(key)
        await self._close_unused_bases()

    def load_config(self, run_id: str) -> RunConfig | TinkerRunConfig:
        with self.db.connect() as conn:
            row = conn.execute(select(Run.kind, Run.config).where(Run.id == uuid.UUID(run_id))).first()
        if row is None:
            raise RunNotFound(f"run {run_id} not found in the runs table")
        return TinkerRunConfig.model_validate(row.config) if row.kind == "tinker" else RunConfig.model_validate(row.config)

    def checkpoint(self, run_id: str, version: int | None = None) -> WeightsPublished | None:
        """The run's newest available checkpoint, or its `version` while the weight server keeps it."""
        query = select(Checkpoint).where(Checkpoint.run_id == uuid.UUID(run_id), Checkpoint.status == "available")
        if version is not None:
            query = query.where(Checkpoint.version == version)
        query = query.order_by(Checkpoint.version.desc()).limit(1)
        with Session(self.db) as session:
            c = session.scalars(query).first()
        if c is None:
            return None
        # a relaying worker is on another machine than the weight server's volume: it fetches over HTTP
        path = None if self.relay is not None else c.path
        return WeightsPublished(run_id=run_id, version=c.version, uri=c.uri, path=path, sha256=c.sha256,
                                bytes=c.bytes, created_at=time.time())

    async def load_newest(self, ctx: RunContext) -> None:
        candidates = [await asyncio.to_thread(self.checkpoint, ctx.run_id), self.announced.get(ctx.run_id)]
        candidates = [c for c in candidates if c is not None]
        if candidates:
            await self.reload(ctx, max(candidates, key=lambda c: c.version))
        WEIGHT_VERSION.labels(ctx.run_id).set(ctx.engine.version)

    async def older_version(self, ctx: RunContext, version: int) -> RunContext:
        """Run ctx at `version`, older than the adapter it serves now: an adapter of its own on the same base
        (key `<run>-v<version>`), loaded from the weight server once and kept while used (the OLDER_VERSIONS_MAX
        used least recently beyond that are dropped, never one serving a request). LookupError when the weight
        server no longer keeps that version (its retention: KEEP_LAST, pins); ValueError for a run of full weights."""
        if not isinstance(ctx.engine, AdapterView):
            raise ValueError(f"run {ctx.run_id} trains full weights: only its newest version is served")
        key = (ctx.run_id, version)
        async with self._older_lock:
            older = self.older.pop(key, None)
            if older is None:
                msg = await asyncio.to_thread(self.checkpoint, ctx.run_id, version)
                if msg is None:
                    raise LookupError(f"version {version} of run {ctx.run_id} is no longer on the weight server "
                                      "(it keeps each run's newest KEEP_LAST versions, pinned ones such as named "
                                      "sampler checkpoints, and what they are built on)")
                manifest = await asyncio.to_thread(self._manifest, msg)
                folder = await asyncio.to_thread(materialize, msg, self.weights_cache, relay=self.relay)
                view = AdapterView(ctx.engine.base, f"{ctx.run_id}-v{version}")
                await view.load_adapter(folder, version, manifest.base_model)
                older = RunContext(ctx.run_id, ctx.config, ctx.chat, view, None, None, asyncio.Lock())
                log.info("serving run %s's older version %d beside v%d", ctx.run_id, version, ctx.engine.version,
                         extra={"run_id": ctx.run_id})
            self.older[key] = older  # the most recently used last
            older.last_used = time.monotonic()
            idle = [k for k, c in self.older.items() if c.running == 0 and k != key]  # least recently used first
            for old in idle[:max(0, len(self.older) - OLDER_VERSIONS_MAX)]:
                await self._drop_older(old)
        return older

    async def _drop_older(self, key: tuple[str, int]) -> None:
        older = self.older.pop(key, None)
        if older is not None:
            await older.engine.close()

    async def on_weights(self, msg: WeightsPublished) -> None:
        if self.relay is not None and msg.path:  # remote from the weight server's volume: over HTTP only
            msg = msg.model_copy(update={"path": None})
        seen = self.announced.get(msg.run_id)
        if seen is None or msg.version > seen.version:
            self.announced[msg.run_id] = msg
        ctx = self.contexts.get(msg.run_id)
        ANNOUNCEMENTS.labels("no" if ctx is None else "yes").inc()
        if ctx is not None:
            await self.reload(ctx, msg)

    async def reload(self, ctx: RunContext, msg: WeightsPublished) -> None:
        """Fetch (checksums verified) and load; on any failure the old weights keep serving."""
        async with ctx.reload_lock:
            if msg.version <= ctx.engine.version:
                return
            try:
                await self._load(ctx, msg)
            except ChecksumError as e:
                RELOADS.labels("checksum_error").inc()
                log.error("checkpoint v%d rejected (%s); still serving v%d", msg.version, e, ctx.engine.version,
                          extra={"run_id": ctx.run_id})
                return
            except Exception:
                RELOADS.labels("error").inc()
                log.exception("loading checkpoint v%d failed; still serving v%d", msg.version, ctx.engine.version,
                              extra={"run_id": ctx.run_id})
                return
            RELOADS.labels("ok").inc()
            WEIGHT_VERSION.labels(ctx.run_id).set(ctx.engine.version)

    def _manifest(self, msg: WeightsPublished) -> CheckpointManifest:
        """`fetch_manifest`, remembering the last few by sha256: a delta's base manifest was the version before's."""
        manifest = self._manifests.get(msg.sha256) or fetch_manifest(msg)
        with self._manifests_lock:  # reloads of different runs run on threads at once
            self._manifests[msg.sha256] = manifest
            while len(self._manifests) > 4:
                del self._manifests[next(iter(self._manifests))]
        return manifest

    async def _load(self, ctx: RunContext, msg: WeightsPublished) -> None:
        manifest = await asyncio.to_thread(self._manifest, msg)
        if (manifest.kind == "delta" and ctx.engine.supports_update
                and ctx.engine.version == manifest.base_version):
            try:
                update = await asyncio.to_thread(self._update, msg, manifest)
                await ctx.engine.apply_update(update)
                return
            except ChecksumError as e:
                RELOADS.labels("delta_rejected").inc()
                log.warning("delta v%d did not verify (%s); loading the full weights instead", msg.version, e,
                            extra={"run_id": ctx.run_id})
            except Exception:  # e.g. the server could not read the delta file: it may hold part of it, so reload whole
                RELOADS.labels("delta_failed").inc()
                log.exception("applying delta v%d failed; loading the full weights instead", msg.version,
                              extra={"run_id": ctx.run_id})
        folder = await asyncio.to_thread(materialize, msg, self.weights_cache, relay=self.relay)
        if manifest.base_model is not None:
            if not isinstance(ctx.engine, AdapterView):
                raise ChecksumError(f"v{msg.version} is a LoRA adapter but run {ctx.run_id} trains full weights")
            await ctx.engine.load_adapter(folder, msg.version, manifest.base_model)
            return
        await ctx.engine.load_weights(folder, msg.version)

    def _update(self, msg: WeightsPublished, manifest: CheckpointManifest) -> WeightUpdate:
        base = self._manifest(version_source(msg, manifest.base_version, manifest.base_sha256))
        return WeightUpdate.load(fetch_checkpoint(msg, self.weights_cache, relay=self.relay), manifest, base)

    async def _close_unused_bases(self) -> None:
        used = {id(c.engine.base) for c in [*self.contexts.values(), *self.older.values()]
                if isinstance(c.engine, AdapterView)}
        for key, base in list(self.bases.items()):
            if id(base) not in used:
                del self.bases[key]
                await base.close()

    async def close(self) -> None:
        for ctx in [*self.contexts.values(), *self.older.values()]:
            await ctx.engine.close()
        for base in self.bases.values():
            await base.close()
