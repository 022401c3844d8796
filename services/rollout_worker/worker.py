"""rollout-worker loops: tasks, keepalive, ended runs, env replies, weights.

A task's EpisodeResult is XADDed to `trajectories`, THEN the task is acked: a worker killed mid-trajectory
leaves its tasks pending and others reclaim them. A task read after its attempt's lease expired is acked
without running. Tasks still running are re-claimed every claim_idle_ms/3, so a live worker's long trajectory
is never taken for a dead one's. The tasks of a run that ended are cancelled and acked, and its later tasks
acked unrun.

More: docs/reliability.md#the-rollout-workers-loops
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Gauge
from sqlalchemy import Engine

from services.rollout_worker.agent_program import AgentPrograms
from services.rollout_worker.env_client import EnvClient
from services.rollout_worker.episodes import failed, run_episode
from services.rollout_worker.gateway import Gateway
from services.rollout_worker.run_engines import RunContext, RunRegistry, RunUnavailable
from services.rollout_worker.settings import RolloutWorkerSettings
from services.rollout_worker.tinker_sampling import TinkerSampling
from services.rollout_worker.weight_relay import Relay
from shared.contracts.messages import EpisodeResult, RolloutTask, WeightsPublished
from shared.contracts.streams import GROUP_ROLLOUT, ROLLOUT_TASKS, TRAJECTORIES, WEIGHTS
from shared.platform import tracing
from shared.platform.bus import REDIS_DOWN, BroadcastReader, Delivery, Redis, StreamBus, StreamConsumer
from shared.platform.logs import get_logger
from shared.platform.retry import RetryPolicy
from shared.platform.service import sleep_or_stop

log = get_logger(__name__)
INFLIGHT = Gauge("rollout_tasks_inflight", "Tasks being run")
EXPIRED = Counter("rollout_tasks_expired_total", "Tasks acked without a result because their attempt's lease "
                  "had expired when they were read (the controller re-dispatches them)", ["when"])
EXPIRED.labels("read")  # the series exists from the start, at 0
# Until Redis takes it: the task is not acked before, so nothing is lost if we die trying.
PUBLISH_RETRY = RetryPolicy(REDIS_DOWN, first_wait_s=1.0, max_wait_s=1.0, what="publishing an episode")
RUN_CHECK_S = 2.0  # how often the runs of the tasks in hand are checked for having ended


class RolloutWorker:
    def __init__(self, cfg: RolloutWorkerSettings, worker_id: str, redis: Redis, db: Engine,
                 relay: Relay | None = None):
        self.cfg, self.worker_id = cfg, worker_id
        self.bus = StreamBus(redis)
        self.consumer = StreamConsumer(self.bus, ROLLOUT_TASKS, GROUP_ROLLOUT, worker_id, expect=RolloutTask,
                                       max_deliveries=cfg.max_deliveries, claim_idle_ms=cfg.claim_idle_ms,
                                       block_ms=cfg.read_block_ms, batch_size=cfg.max_concurrency)
        self.envs = EnvClient(self.bus, worker_id, cfg.env_reply_margin_s)
        self.runs = RunRegistry(db, cfg.weights_cache, cfg.hf_batch_wait_ms, relay)
        self.gateway = Gateway(cfg.gateway_host, cfg.gateway_port, cfg.gateway_public_host, cfg.gateway_token)
        self.programs = AgentPrograms(self.gateway, cfg.agent_memory_bytes)
        self.running: dict[asyncio.Task, Delivery] = {}
        self.ended: set[str] = set()  # runs that ended: their tasks are acked unrun
        self.status: dict = {}
        self.weights = BroadcastReader(redis, WEIGHTS, WeightsPublished)
        self.tinker = TinkerSampling(self)  # the Tinker API's sample requests (`tinker.samples`)

    async def start(self) -> None:
        # transformers takes seconds to import: pay it before the heartbeat says we serve, not in the first
        # trajectories of every run (it was most of bench-rollout's ramp-up).
        await asyncio.to_thread(_preload_transformers)
        await self.consumer.start()
        await self.envs.start()
        await self.gateway.start()
        await self.weights.start()
        await self.tinker.start()

    def loops(self, stop: asyncio.Event) -> list:
        self.status["gateway_port"] = self.gateway.port  # status is the runtime's dict by now (main.py)
        self.status["gateway_url"] = f"http://{self.gateway.public_host}:{self.gateway.port}"  # API forwards claims
        return [self.task_loop(stop), self.keepalive_loop(stop), self.envs.reader(stop), self.weights_loop(stop),
                self.evict_loop(stop), self.ended_loop(stop), self.tinker.loop(stop)]

    async def evict_loop(self, stop: asyncio.Event) -> None:
        while not await sleep_or_stop(stop, min(60.0, self.cfg.run_idle_s / 4)):
            await self.runs.evict_idle(self.cfg.run_idle_s)
            self.status["runs"] = len(self.runs.contexts)

    async def ended_loop(self, stop: asyncio.Event) -> None:
        while not await sleep_or_stop(stop, RUN_CHECK_S):
            in_hand = ({d.message.run_id for d in self.running.values()} | set(self.runs.contexts)) - self.ended
            if not in_hand:
                continue
            try:
                ended = await asyncio.to_thread(self.runs.ended, in_hand)
            except Exception as e:  # Postgres unreachable: the tasks go on, checked again next time
                log.warning("cannot check whether runs have ended: %s", e)
                continue
            for run_id in ended - self.ended:
                log.info("run %s has ended: dropping its tasks here", run_id, extra={"run_id": run_id})
            self.ended |= ended
            for task, d in list(self.running.items()):
                if d.message.run_id in ended:
                    task.cancel()  # run_task acks it
            for run_id in ended:
                await self.runs.forget(run_id)

    # -- tasks -----------------------------------------------------------------------------------------------
    async def task_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            free = self.cfg.max_concurrency - len(self.running)
            if free <= 0:
                await asyncio.wait(list(self.running), timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                continue
            self.consumer.batch_size = free
            try:
                deliveries = await self.consumer.read()
            except REDIS_DOWN:
                await asyncio.sleep(0.5)
                continue
            busy = {d.id for d in self.running.values()}
            for d in deliveries:
                if d.id in busy:  # our own, reclaimed by us: already running
                    continue
                task = asyncio.create_task(self.run_task(d))
                self.running[task] = d
                task.add_done_callback(self._finished)
            self._report()
        await self.drain()

    def _report(self) -> None:
        """What the heartbeat says this worker runs: the controller renews these tasks' leases."""
        INFLIGHT.set(len(self.running))
        self.status["inflight"] = len(self.running)
        self.status["holds"] = [list(d.message.key) for d in self.running.values()]

    def _finished(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)
        self._report()  # else /healthz shows the tasks of the last read, stale
        if not task.cancelled() and task.exception() is not None:
            log.error("task runner crashed", exc_info=task.exception())

    async def run_task(self, delivery: Delivery) -> None:
        """Run the task and publish its result, then ack it; or, when its attempt's lease had expired before it
        was read, ack it with no result.

        No EpisodeResult for an expired attempt: the controller's ledger expires it as lost and re-dispatches
        attempt+1, so nothing is lost; a `failed` reply would instead be dropped as late or, if it beat the
        expiry pass, count towards the run's fail-fast streak, which a backlog says nothing about. Once read, a
        task runs to its end: the controller renews the lease of what the heartbeat lists (`_report`).
        The lease is on the controller's clock. Skew between hosts only delays: a worker clock ahead skips an
        attempt a little early, and the ledger re-dispatches it at its own expiry (as a lost attempt, like any
        late one); a clock behind runs it as if the lease were unknown."""
        task: RolloutTask = delivery.message
        if task.run_id in self.ended:
            return await self.consumer.ack([delivery])
        try:
            await self._run_task(delivery, task)
        except asyncio.CancelledError:
            if task.run_id not in self.ended:  # a stop of this worker: unacked, another worker reclaims it
                raise
            await self.consumer.ack([delivery])  # the run ended: nothing to reclaim

    async def _run_task(self, delivery: Delivery, task: RolloutTask) -> None:
        picked_up = time.time()
        left = task.lease_left(picked_up)
        if left <= 0:
            return await self.give_up(delivery, "read", f"its lease expired {-left:.1f}s before it was read")
        tracing.start_span("queue", task.traceparent, start=task.dispatched_at).end()  # dispatch -> pick-up
        with tracing.span("rollout", task.traceparent, worker_id=self.worker_id, run_id=task.run_id,
                          task_id=task.task_id, sample_idx=task.sample_idx, attempt=task.attempt,
                          queue_wait_ms=round((picked_up - task.dispatched_at) * 1000, 1)) as span:
            result = await self._rollout(task)
            span.set_attributes({"status": result.status, "termination_reason": result.termination_reason.value})
            result.traceparent = tracing.traceparent()
            if result.traceparent:  # in the episode's info: SQL and the dashboard find the unit's trace by it
                result.info["trace_id"] = tracing.trace_id(result.traceparent)
        await self.publish(result)
        await self.consumer.ack([delivery])  # only after the result is in `trajectories`

    async def _rollout(self, task: RolloutTask) -> EpisodeResult:
        try:
            # Not under the lease: the run's context (tokenizer, engine) is built once and shared by its tasks;
            # cancelling its build would leave a half-started engine behind and the next task building another.
            # Only a run that ended (ended_loop) or this worker's stop cancel it.
            ctx = await self.runs.get(task.run_id)
        except Exception as e:
            # the build's own failure with its traceback; the same reason again for the next tasks, one line each
            log.error("cannot serve run %s: %s", task.run_id, e, extra={"run_id": task.run_id},
                      exc_info=not isinstance(e, RunUnavailable) or e.__cause__ is not None)
            return failed(task, f"rollout worker cannot serve the run: {e}")
        return await self.run(ctx, task)  # within its trajectory budget; its lease renewed meanwhile

    async def run(self, ctx: RunContext, task: RolloutTask) -> EpisodeResult:
        with ctx.in_use():
            if ctx.config.agent_program is not None:  # the user's program, through our gateway
                result = await self.programs.run(ctx, task)
            else:
                result = await run_episode(ctx, self.envs, task, self.worker_id, self.cfg.error_retries)
        result.worker_id = self.worker_id
        return result

    async def give_up(self, delivery: Delivery, when: str, why: str) -> None:
        task: RolloutTask = delivery.message
        EXPIRED.labels(when).inc()
        log.info("task %s given up: %s; the controller re-dispatches it", task.key, why, extra={"run_id": task.run_id})
        await self.consumer.ack([delivery])

    async def publish(self, result: EpisodeResult) -> None:
        await PUBLISH_RETRY.call_async(lambda: self.bus.publish(TRAJECTORIES, result))

    async def keepalive_loop(self, stop: asyncio.Event) -> None:
        interval = self.cfg.claim_idle_ms / 3000
        while not await sleep_or_stop(stop, interval):
            await self.consumer.keep_alive(list(self.running.values()))

    async def drain(self) -> None:
        if not self.running:
            return
        log.info("waiting up to %.0fs for %d running trajectories", self.cfg.drain_timeout_s, len(self.running))
        _, pending = await asyncio.wait(list(self.running), timeout=self.cfg.drain_timeout_s)
        for t in pending:  # unacked: another worker reclaims and re-runs them
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # -- weights ---------------------------------------------------------------------------------------------
    async def weights_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for msg in await self.weights.read():
                await self.runs.on_weights(msg)

    async def close(self) -> None:
        await self.gateway.close()
        await self.runs.close()


def available_engines() -> list[str]:
    """Engine types this worker can run (what its heartbeat advertises; POST /v1/runs refuses an engine no
    live worker offers). Checked by installed package, without importing it."""
    from importlib.util import find_spec

    needs = {"hf": ("torch", "transformers"), "openai": ("httpx",), "vllm": ("vllm",)}
    return [engine for engine, modules in needs.items() if all(find_spec(m) is not None for m in modules)]


def _preload_transformers() -> None:
    try:
        import safetensors.numpy  # noqa: F401  (the first weight delta must not pay for these imports)
        import xxhash  # noqa: F401
        import zstandard  # noqa: F401
        from transformers import AutoTokenizer  # noqa: F401
    except ImportError:  # the engine reports it, with the extra to install, when a run needs it
        pass
