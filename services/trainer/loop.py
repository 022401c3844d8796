"""The trainer service loop: consume `results.accepted` (group "train"), train whole groups with verl,
checkpoint, record, report, publish, and only then acknowledge.

The trainer makes no acceptance decision; it keeps its own effects exactly-once across crashes: a step's
inputs stay pending while it trains, its checkpoint is renamed into place, one transaction records the used
samples, then publish, report on `trainer.progress`, acknowledge. A group that will not be trained on is
recorded with its reason, reported, then acknowledged. Several trainers share the "train" group, each training
the runs whose lease it holds.

More: docs/reliability.md#the-trainers-step-exactly-once
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import Engine

from services.trainer import batch as batching
from services.trainer import run_store as db
from services.trainer import tracking
from services.trainer.batch import Group, GroupBuffer, GroupKey, SampleKey
from services.trainer.learner import rollout_idle_ratio
from services.trainer.publisher import WeightPublisher
from services.trainer.settings import TrainerSettings
from services.trainer.state import CheckpointDir, SampleRecord, StepRecord
from services.trainer.tinker_models import TinkerModels
from services.trainer.tracking import RunTrackers
from shared.contracts.messages import AcceptedResult, ConsumedGroup, RunControl, TrainerProgress
from shared.contracts.run_config import RunConfig
from shared.contracts.streams import ACCEPTED_RESULTS, GROUP_TRAIN, RUN_CONTROL, TRAINER_PROGRESS
from shared.platform import tracing
from shared.platform.bus import Delivery, Redis, RedisError, StreamBus, StreamConsumer
from shared.platform.db.session import DB_DOWN
from shared.platform.logs import get_logger
from shared.platform.service import sleep_or_stop

log = get_logger(__name__)
STEPS = Counter("trainer_steps_total", "Optimizer steps (policy versions) completed", ["run_id"])
SAMPLES = Counter("trainer_samples_total", "Samples consumed, by outcome", ["outcome"])
STEP_SECONDS = Histogram("trainer_step_seconds", "Train + checkpoint + record + publish per version",
                         buckets=(0.1, 0.3, 1, 3, 10, 30, 100, 300))
VERSION = Gauge("trainer_policy_version", "Latest policy version", ["run_id"])


@dataclass
class RunState:
    """A run this process owns: its model, its buffer of groups, the deliveries held for the next step."""

    run_id: str
    config: RunConfig
    version: int
    learner: object
    engine: object
    ckpts: CheckpointDir
    buffer: GroupBuffer
    held: dict[SampleKey, Delivery] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # samples dropped since the last step, by reason
    counts: dict[str, int] = field(default_factory=dict)
    # Keys of groups that can never complete: a slot out of attempts, or a stored result with nothing to train
    # on (the controller does not retry a completed result). Their samples are dropped (and refilled).
    unfinishable: set[GroupKey] = field(default_factory=set)
    report_all: bool = False  # a progress report was lost (Redis down): re-send the whole record at the next poll
    trackers: RunTrackers | None = None  # W&B / MLflow / TensorBoard, when the run or the settings name any
    last_step_at: float = field(default_factory=time.monotonic)  # opened, or the last step: results arrive since
    generated_tokens: int = 0  # model-generated tokens of the results held since the last step
    last_step_wall: float = field(default_factory=time.time)  # the same moment on the wall clock (results' stamps)
    episode_spans: list[tuple[str, float, float]] = field(default_factory=list)  # (worker, started, finished)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n
        SAMPLES.labels(what).inc(n)

    @property
    def done(self) -> bool:
        return self.config.total_steps is not None and self.version >= self.config.total_steps


class Trainer:
    def __init__(self, settings: TrainerSettings, redis: Redis, db_engine: Engine, worker_id: str):
        self.settings, self.redis, self.db, self.worker_id = settings, redis, db_engine, worker_id
        self.bus = StreamBus(redis)
        self.consumer = StreamConsumer(
            self.bus, ACCEPTED_RESULTS, GROUP_TRAIN, worker_id, expect=AcceptedResult,
            # Entries are held until the step that uses them is durable, however long that takes: no timer takes
            # them from a live trainer, and no count of deliveries dead-letters them (claim_pending takes over).
            max_deliveries=None, claim_idle_ms=None, batch_size=settings.read_batch, block_ms=settings.read_block_ms)
        # A user's stop (`run.control`): the run is let go at once instead of at the next poll of the runs table
        self.control = StreamConsumer(self.bus, RUN_CONTROL, GROUP_TRAIN, worker_id, expect=RunControl, block_ms=None)
        self.publisher = WeightPublisher(settings.weight_server_url, settings.weights_dir, settings.publish_timeout_s,
                                         settings.delta_zstd_level)
        self.torch_thread = ThreadPoolExecutor(1, thread_name_prefix="torch")  # all verl work on one thread
        self.tinker = TinkerModels(self)  # Tinker training clients (`tinker.requests`, `tinker.ops.*`), beside the runs
        self.runs: dict[str, RunState] = {}
        self.closed_trackers: list[RunTrackers] = []  # let go, their last calls perhaps still running
        self.foreign: set[str] = set()  # runs another trainer holds
        self.broken: dict[str, str] = {}  # runs this trainer cannot train (error), left alone until restart
        self.claim_due = True  # a run was opened: pending entries of the group may be ours now
        self.status: dict = {}

    # -- the loop ---------------------------------------------------------------------------------------------
    async def serve(self, stop: asyncio.Event) -> None:
        await self.consumer.start()
        await self.control.start()
        await self.tinker.start()
        while not stop.is_set():
            try:
                await self.train(stop)
            except DB_DOWN as e:
                await self.outage(stop, e)
        await self.close()

    async def train(self, stop: asyncio.Event) -> None:
        await self.refresh_runs()
        next_poll = time.monotonic() + self.settings.runs_poll_s
        next_sweep = time.monotonic()
        while not stop.is_set():
            if time.monotonic() >= next_poll:
                await self.refresh_runs()
                for run in list(self.runs.values()):
                    if run.report_all:
                        await self.report_record(run)
                await self.tinker.renew()
                next_poll = time.monotonic() + self.settings.runs_poll_s
            if time.monotonic() >= next_sweep:
                await self.tinker.sweep_checkpoints()
                next_sweep = time.monotonic() + self.settings.tinker_sweep_s
            while self.claim_due:  # routing claimed entries may open further runs
                self.claim_due = False
                await self.claim_pending()
            await self.route(await self.consumer.read())
            await self.control.process(self.apply_control, await self.control.read())
            await self.tinker.poll()
            for run in list(self.runs.values()):
                await self.maybe_step(run)

    async def outage(self, stop: asyncio.Event, error: Exception) -> None:
        """Postgres is unreachable. A step cut short by it may have trained the model in memory without its
        record, so every run is let go as a crash would leave it (its entries pending, its checkpoint on disk)
        and opened again from that checkpoint once Postgres answers: what a restart does, without one."""
        log.warning("database unreachable (%r): letting go of %d runs until it answers; each is opened again "
                    "from its checkpoint", error, len(self.runs))
        for run_id in list(self.runs):
            await self.close_run(run_id, release=False)
        self.foreign.clear()
        self.claim_due = True  # the let-go runs' entries are pending at this consumer: routed again
        delay = 1.0
        while not stop.is_set():
            await sleep_or_stop(stop, delay)
            try:
                await asyncio.to_thread(db.ping, self.db)
                log.info("database reachable again: opening the runs again")
                return
            except DB_DOWN:
                delay = min(2 * delay, 10.0)

    async def claim_pending(self) -> None:
        """Take over every entry the group still has pending (a dead trainer's, ours before a crash) and route
        it: entries of our runs are held (those already held are recognised), those of runs another trainer
        owns are left pending, those of runs nobody trains are acknowledged."""
        async for deliveries in self.consumer.take_over_pending():
            await self.route(deliveries)

    # -- runs -------------------------------------------------------------------------------------------------
    async def refresh_runs(self) -> None:
        active = {r.id: r for r in await asyncio.to_thread(db.active_runs, self.db) if r.id not in self.broken}
        held = await self._leases(list(active))
        for run_id in list(self.runs):
            if run_id not in active:  # stopping or ended: nothing will train on what it still holds
                await self.close_run(run_id, ack_held=True)
            elif run_id not in held:  # our lease lapsed and another trainer took the run
                await self.close_run(run_id)
        self.foreign = set(active) - held
        for run_id in held - set(self.runs):
            await self.open_run(active[run_id])
        from services.trainer.lora_shared_engine import engines_held

        # model_copies: copies of a model held (LoRA runs of one kind share one)
        self.status.update(runs={r.run_id: r.version for r in self.runs.values()}, trains=sorted(self.runs),
                           broken=self.broken, model_copies=engines_held(), tinker_models=sorted(self.tinker.held),
                           tracker_warnings={r.run_id: r.trackers.warning for r in self.runs.values()
                                             if r.trackers is not None and r.trackers.warning})

    async def apply_control(self, deliveries: list[Delivery]) -> None:
        """A stopped run of ours is closed now, acknowledging what it held (as `refresh_runs` does for a run no
        longer active); pause and resume change nothing here: a paused run keeps training on what arrived."""
        for d in deliveries:
            if d.message.action == "stop" and d.message.run_id in self.runs:
                log.info("run stopped by its user", extra={"run_id": d.message.run_id})
                await self.close_run(d.message.run_id, ack_held=True)

    async def _leases(self, run_ids: list[str]) -> set[str]:
        return await asyncio.to_thread(db.hold_leases, self.db, self.worker_id, run_ids, self.settings.lease_ttl_s)

    async def open_run(self, row: db.RunRow) -> None:
        """Train a run whose lease this process holds: load its state, then report its whole record."""
        try:
            run = await self._in_torch(self._build_run, row)
        except DB_DOWN:  # not the run's fault: opened again once Postgres answers
            raise
        except Exception as e:  # one bad run (missing checkpoint, bad model path) must not stop the others
            log.exception("cannot train run %s", row.id, extra={"run_id": row.id})
            self.broken[row.id] = repr(e)
            try:  # the controller records it in the run's history and its stall reason
                await self.bus.publish(TRAINER_PROGRESS, TrainerProgress(run_id=row.id, version=0, error=repr(e)))
            except (RedisError, OSError) as pe:
                log.warning("could not report that run %s cannot be trained: %r", row.id, pe)
            await asyncio.to_thread(db.release_leases, self.db, self.worker_id, [row.id])
            return
        self.runs[row.id] = run
        self.claim_due = True
        if options := tracking.resolve(run.config, self.settings):
            await self.open_trackers(run, options)
        await self.report_record(run)
        VERSION.labels(row.id).set(run.version)
        log.info("training run %s from version %d", row.id, run.version, extra={"run_id": row.id})

    async def open_trackers(self, run: RunState, options: dict[str, dict]) -> None:
        """Start the run's trackers and re-send each the committed versions it does not hold (all of them for a
        new tracker; those after its last recorded version when the run was trained before)."""
        logged = await asyncio.to_thread(db.tracked_versions, self.db, run.run_id)
        run.trackers = RunTrackers(run.run_id, run.config, options, logged=logged,
                                   on_logged=partial(db.record_tracked, self.db, run.run_id),
                                   hung_after_s=self.settings.tracking_hung_after_s)
        run.trackers.start()
        missed = await asyncio.to_thread(db.step_metrics, self.db, run.run_id, min(run.trackers.logged.values()))
        for version, metrics in missed.items():
            run.trackers.log(metrics, version)

    def _build_run(self, row: db.RunRow) -> RunState:
        """Load the model (from the latest complete checkpoint, if any) and finish an interrupted step."""
        from services.trainer.learner import Learner
        from services.trainer.ranks import close_run_engine, open_run_engine

        config = RunConfig.model_validate(row.config)
        s = self.settings
        engine = open_run_engine(row.id, config.model, config.algorithm, seed=config.seed, device=s.device,
                                 dtype=s.dtype, group_size=config.samples_per_task,
                                 temperature=config.sampling.temperature, **s.engine_options())
        ckpts = CheckpointDir(s.state_dir, row.id, s.keep_checkpoints)
        try:
            version = self._recover(row, engine, ckpts)
            unfinishable = db.unfinishable_groups(self.db, row.id)
        except Exception:
            close_run_engine(row.id)
            raise
        tokenizer = engine.model_config.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        run = RunState(row.id, config, version, Learner(engine, config.algorithm, pad_id), engine, ckpts,
                       GroupBuffer(config.samples_per_task, need_greedy=config.algorithm.adv_estimator == "remax"))
        run.unfinishable = unfinishable
        return run

    def _recover(self, row: db.RunRow, engine, ckpts: CheckpointDir) -> int:
        latest = ckpts.latest()
        committed = db.recorded_version(self.db, row.id)
        if latest is None:
            if committed > 0:
                raise RuntimeError(f"run {row.id} is at policy version {committed} but {ckpts.root} has "
                                   "no trainer checkpoint: restore STATE_DIR or start a new run")
            return 0
        path, record = latest
        if record.version < committed:
            raise RuntimeError(f"run {row.id}: newest trainer checkpoint is v{record.version} but the run is at "
                               f"v{committed}; restore the newer checkpoint into {ckpts.root}")
        engine.load(path)
        if record.version > committed:  # crashed between checkpoint and commit: replay the commit
            db.commit_step(self.db, record)
        if not db.is_published(self.db, row.id, record.version):
            self._publish(row.id, engine, record.version, record.metrics)
        return record.version

    async def close_run(self, run_id: str, ack_held: bool = False, release: bool = True) -> None:
        """Forget a run. Held entries are acknowledged when the run ended (else they would pin the stream
        against trimming); otherwise they stay pending for whichever trainer takes the run next. `release`:
        give up its lease now (not while Postgres is unreachable: it lapses, or this trainer renews it)."""
        run = self.runs.pop(run_id, None)
        if run is not None:
            from services.trainer.ranks import close_run_engine

            await self._in_torch(close_run_engine, run_id)
            if ack_held:
                await self.consumer.ack(list({d.id: d for d in run.held.values()}.values()))
            if run.trackers is not None:  # an ended run gets its summary; one merely let go, none
                summary = None
                if ack_held:
                    row = await asyncio.to_thread(db.load_run, self.db, run_id)
                    summary = {"status": row.status if row else "deleted", "policy_version": run.version}
                run.trackers.finish(summary)
                self.closed_trackers = [t for t in self.closed_trackers if not t.join(0)] + [run.trackers]
            log.info("released run %s at version %d", run_id, run.version, extra={"run_id": run_id})
        if release:
            await asyncio.to_thread(db.release_leases, self.db, self.worker_id, [run_id])

    async def close(self) -> None:
        from services.trainer.ranks import stop_followers

        for run_id in list(self.runs):
            await self.close_run(run_id)
        await self.tinker.close()
        await self._in_torch(stop_followers)
        self.torch_thread.shutdown(wait=True)
        # the runs' trackers flushed (W&B's files, TensorBoard's events), unless one hangs: its thread is a daemon
        deadline = time.monotonic() + self.settings.tracking_flush_s
        for trackers in self.closed_trackers:
            await asyncio.to_thread(trackers.join, max(deadline - time.monotonic(), 0))

    # -- intake -----------------------------------------------------------------------------------------------
    async def route(self, deliveries: list[Delivery]) -> None:
        by_run: dict[str, list[Delivery]] = {}
        for d in deliveries:
            by_run.setdefault(d.message.run_id, []).append(d)
        for run_id, items in by_run.items():
            if run_id not in self.runs and run_id not in self.foreign and run_id not in self.broken:
                await self._maybe_open(run_id)
            if run_id in self.runs:
                await self.intake(self.runs[run_id], items)
            elif run_id not in self.foreign and run_id not in self.broken:  # not a training run (eval, finished, unknown): nothing to do
                await self.consumer.ack(items)

    async def _maybe_open(self, run_id: str) -> None:
        row = await asyncio.to_thread(db.load_run, self.db, run_id)
        if row is None or not row.trainable:
            return
        if run_id in await self._leases([run_id]):
            await self.open_run(row)
        else:
            self.foreign.add(run_id)

    async def intake(self, run: RunState, deliveries: list[Delivery]) -> None:
        """Hold what will be trained on; record what never will be (a result with nothing to train on, a slot
        out of attempts), then acknowledge it and duplicates."""
        keys = [(d.message.task_id, d.message.sample_idx, d.message.attempt) for d in deliveries]
        recorded = await asyncio.to_thread(db.consumed, self.db, run.run_id, keys)
        ack_now, final = [], []
        for d, key in zip(deliveries, keys, strict=True):
            outcome = self._classify(run, d, key, recorded)
            if outcome == "held":
                run.held[(run.run_id, key[0], key[1])] = d
                result = d.message.result
                run.count(f"ended_{result.termination_reason.value}")  # metric samples_ended_<reason>
                if 0 < result.started_at <= result.finished_at:  # stamped by a rollout worker
                    run.episode_spans.append((result.worker_id, result.started_at, result.finished_at))
                for sample in batching.samples_from_result(result, run.config.algorithm.mask_termination):
                    run.buffer.add(sample)
                    if sample.masked:  # metric samples_masked_<reason>: stored and scored, no loss
                        run.count(f"masked_{sample.masked}")
                    # tokens with a policy version are the model's (-1: an env's, inside multi-turn responses)
                    run.generated_tokens += (sum(v >= 0 for v in sample.versions) if sample.versions
                                             else len(sample.response_ids))
            elif outcome in ("excluded", "abandoned"):
                final.append((d, outcome))  # recorded below, and its group is dropped
            elif outcome == "duplicate" and (k := (run.run_id, key[0], key[1])) in run.held:
                ack_now.append(run.held[k])  # keep the newest entry pending: the older may be gone with Redis's data
                run.held[k] = d
            elif outcome != "already_held":
                ack_now.append(d)
            run.report_all = run.report_all or outcome == "duplicate"  # a replay: the reports may be lost too
            run.count(outcome)
        if final:  # recorded before the ack: a re-delivery after a crash is then a duplicate
            records = [SampleRecord(task_id=d.message.task_id, sample_idx=d.message.sample_idx,
                                    attempt=d.message.attempt, status=status, batch_idx=d.message.batch_idx,
                                    generated_version=d.message.result.policy_versions[0] if d.message.result
                                    else None) for d, status in final]
            await asyncio.to_thread(db.record_dropped, self.db, run.run_id, run.version, records)
            run.unfinishable |= {(d.message.task_id, d.message.batch_idx) for d, _ in final}
            await self.report(run, run.version, [ConsumedGroup(task_id=d.message.task_id, batch_idx=d.message.batch_idx,
                                                               status=s) for d, s in final if s == "excluded"])
            ack_now += [d for d, _ in final]
        await self.consumer.ack(ack_now)
        await self.drop_unfinishable(run)

    @staticmethod
    def _classify(run: RunState, d: Delivery, key, recorded: set) -> str:
        held = run.held.get((run.run_id, key[0], key[1]))
        if held is not None:
            return "already_held" if held.id == d.id else "duplicate"
        if (key[0], key[1]) in recorded:
            return "duplicate"
        if d.message.result is None:
            return "abandoned"  # the controller gave up on this slot: its group can never complete
        if batching.excluded_reason(d.message.result) is not None:
            return "excluded"
        return "held"

    # -- reports to the controller ----------------------------------------------------------------------------
    async def report(self, run: RunState, version: int, groups: list[ConsumedGroup]) -> None:
        """Tell the controller the run's version and the groups just consumed. If Redis refuses, the whole
        record is re-sent at the next poll (reports are idempotent)."""
        try:
            await self.bus.publish(TRAINER_PROGRESS, TrainerProgress(run_id=run.run_id, version=version,
                                                                     groups=groups))
        except (RedisError, OSError) as e:
            log.warning("progress report failed, re-sent later: %r", e, extra={"run_id": run.run_id})
            run.report_all = True

    async def report_record(self, run: RunState, chunk: int = 500) -> None:
        """Re-send everything this trainer recorded for the run (when it opens it, or after a lost report)."""
        run.report_all = False
        groups = await asyncio.to_thread(db.consumed_groups, self.db, run.run_id)
        for i in range(0, max(len(groups), 1), chunk):
            await self.report(run, run.version, groups[i:i + chunk])

    # -- one step ---------------------------------------------------------------------------------------------
    async def maybe_step(self, run: RunState) -> None:
        if run.done:
            return
        cfg = run.config
        chosen, dropped = batching.select_groups(
            run.buffer.complete_groups(), cfg.tasks_per_batch, dynamic_sampling=cfg.algorithm.dynamic_sampling,
            version=run.version, max_staleness=cfg.max_staleness, stale_policy=cfg.stale_policy)
        for reason, groups in dropped.items():
            await self.drop(run, reason, groups)
        if len(chosen) == cfg.tasks_per_batch:
            run.buffer.remove(chosen)
            with STEP_SECONDS.time(), tracing.span("train.step", root=True, links=self._links(run, chosen),
                                                   run_id=run.run_id,
                                                   policy_version=run.version + 1, groups=len(chosen)):
                await self.step(run, chosen)

    async def drop(self, run: RunState, reason: str, groups: list[Group]) -> None:
        """Record groups that will never be trained on as consumed (reason as status), then acknowledge them.
        A crash in between is safe: re-delivered entries of recorded samples are duplicates."""
        run.buffer.remove(groups)
        records = self._records(groups, reason)
        await asyncio.to_thread(db.record_dropped, self.db, run.run_id, run.version, records)
        await self.report(run, run.version, self._consumed(groups, reason))
        await self.consumer.ack(self._release(run, records))
        run.dropped[reason] = run.dropped.get(reason, 0) + len(records)
        log.info("dropped %d groups (%s)", len(groups), reason, extra={"run_id": run.run_id})

    async def drop_unfinishable(self, run: RunState) -> None:
        """Drop the waiting groups that can never complete (`run.unfinishable`)."""
        waiting = run.buffer.incomplete_groups()
        if not waiting:
            return
        groups = batching.doomed_groups(waiting, run.unfinishable)
        if groups:
            await self.drop(run, "incomplete", groups)

    async def step(self, run: RunState, groups: list[Group]) -> None:
        version = run.version + 1
        started = time.monotonic()
        probe = batching.mismatch_probe(run.buffer, run.version)  # the mismatch at run.version, when the batch has none
        metrics = await self._in_torch(partial(run.learner.step, probe=probe), groups, run.version, version)
        # verl's async figures: the share of this step's cycle the trainer waited for the run's data, and how
        # idle the rollout workers were over the same cycle, as far as their results have arrived
        cycle = max(time.monotonic() - run.last_step_at, 1e-6)
        metrics["fully_async/trainer/idle_ratio"] = (started - run.last_step_at) / cycle
        idle = rollout_idle_ratio(run.episode_spans, run.last_step_wall, time.time())
        if idle is not None:
            metrics["fully_async/rollouter/idle_ratio"] = idle
        metrics |= {f"dropped_{k}": float(n) for k, n in run.dropped.items()}
        metrics |= {f"samples_{k}": float(n) for k, n in run.counts.items()}
        # the rollout side as it reaches this trainer: results the store accepted, and their generated tokens,
        # per second since the previous step (or since the run opened)
        elapsed = max(time.monotonic() - run.last_step_at, 1e-6)
        metrics["trajectories_per_s"] = run.counts.get("held", 0) / elapsed
        metrics["rollout_tokens_per_s"] = run.generated_tokens / elapsed
        if run.trackers is not None:  # failed tracker calls so far (the calls run after the step: a step behind)
            metrics["tracker_errors"] = float(run.trackers.errors)
        record = StepRecord(run_id=run.run_id, version=version, samples=self._records(groups), metrics=metrics)
        await self._in_torch(run.ckpts.save, run.engine, record)
        await asyncio.to_thread(db.commit_step, self.db, record)
        await self._in_torch(self._publish, run.run_id, run.engine, version, metrics)
        # reported once published: the controller completes the run at its last version, whose weights exist
        await self.report(run, version, self._consumed(groups, "used"))
        await self.consumer.ack(self._release(run, record.samples))
        run.version, run.dropped, run.counts, run.last_step_at = version, {}, {}, time.monotonic()
        run.generated_tokens, run.last_step_wall, run.episode_spans = 0, time.time(), []
        if run.trackers is not None:  # the step is durable: what the trackers show never runs ahead of the record
            run.trackers.log(metrics, version)
        STEPS.labels(run.run_id).inc()
        VERSION.labels(run.run_id).set(version)
        log.info("v%d reward %.3f (%d samples, %.2fs)", version, metrics["reward_mean"], len(record.samples),
                 metrics["step_s"], extra={"run_id": run.run_id, "policy_version": version})

    @staticmethod
    def _records(groups: list[Group], dropped: str | None = None) -> list[SampleRecord]:
        """One record per sample: used (the greedy baseline: baseline), or the reason the group was dropped."""
        def rec(s, status):
            return SampleRecord(task_id=s.key[1], sample_idx=s.key[2], attempt=s.attempt, status=status,
                                generated_version=s.min_version, batch_idx=s.group[1])
        out = {}
        for g in groups:
            for s in g.samples.values():
                out[s.key] = rec(s, dropped or "used")
            for greedy in g.greedy.values():
                out[greedy.key] = rec(greedy, dropped or "baseline")
        return list(out.values())

    @staticmethod
    def _links(run: RunState, groups: list[Group]) -> list:
        """One step serves many units: its own trace, linked to the store span of each unit it trains on."""
        if not tracing.enabled():
            return []
        held = {d.id: d for g in groups for s in g.all_samples() if (d := run.held.get(s.key)) is not None}
        return [lk for d in held.values() for lk in tracing.link(d.message.traceparent)]

    @staticmethod
    def _consumed(groups: list[Group], status: str) -> list[ConsumedGroup]:
        return [ConsumedGroup(task_id=g.key[0], batch_idx=g.key[1], status=status) for g in groups]

    @staticmethod
    def _release(run: RunState, records: list[SampleRecord]) -> list[Delivery]:
        out = {}
        for s in records:
            d = run.held.pop((run.run_id, s.task_id, s.sample_idx), None)
            if d is not None:
                out[d.id] = d
        return list(out.values())

    def _publish(self, run_id: str, engine, version: int, metrics: dict[str, float]) -> None:
        run = self.runs.get(run_id)
        config = run.config if run is not None else RunConfig.model_validate(db.load_run(self.db, run_id).config)
        if config.algorithm.lora is not None:  # the adapter alone, tied to the base it was trained on
            self.publisher.publish_adapter(run_id, version, engine, config.model, metrics, config.engine.weights_dtype,
                                           self.settings.best_metric)
            return
        folder = self.publisher.staging_folder(run_id, version)
        device = self.settings.device if self.settings.delta_on_device else "cpu"
        tensors = engine.export_hf(folder, config.engine.weights_dtype, weights=False, device=device)
        self.publisher.publish(run_id, version, folder, metrics, self.settings.best_metric, tensors=tensors)

    async def _in_torch(self, fn, *args):
        """`fn(*args)` on the torch thread. Work longer than a third of the lease TTL (a long step, a model being
        opened) renews this trainer's leases meanwhile: a live trainer busy with a run or a Tinker model keeps it,
        where another trainer of the fleet would otherwise take it over as a dead one's."""
        work = asyncio.get_running_loop().run_in_executor(self.torch_thread, fn, *args)
        while not (await asyncio.wait({work}, timeout=self.settings.lease_ttl_s / 3))[0]:
            held = list(self.runs) + [run_id for run_id, _ in self.tinker.held.values()]
            try:
                await self._leases(held)
            except DB_DOWN as e:  # the work goes on; the loop deals with the outage after it
                log.warning("could not renew leases during long torch work: %r", e)
        return work.result()
