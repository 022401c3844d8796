"""The controller's loops. One process drives many runs; each run is driven by whichever controller holds
its controller lease (shared/leases.py). Five loops, each short:

- drive: renew leases and read run status, policy version and groups the trainer dropped (every
  poll_interval_s), then per run: pick up ended ledger rows, flip lifecycle status (failing the run fast when
  its attempts keep failing for one reason; taking back its queued tasks when it stops), dispatch into the
  window (ledger row first, then XADD; under ROLLOUT_CAPACITY at most the run's share, share.py). A slot out of attempts of a training run is announced on `results.accepted`
  (after its `final_failure` event commits; again whenever a controller rebuilds the run), so the trainer
  drops its group. Woken early whenever the store commits results, so dispatch keeps up with completions.
  Every reconcile_interval_s it also marks dispatched tasks whose lease expired as lost (re-dispatched as
  attempt+1 while attempts remain, which also covers Redis losing its data).
- store: group "store" on `trajectories` -> TrajectoryStore (the one place that decides acceptance), then the
  accepted completed results of training runs -> `results.accepted`, then ack (any controller stores any run).
- progress: group "controller" on `trainer.progress` -> runs.policy_version and `consumed_groups`, ack after
  commit: all the controller knows of the trainer comes this way.
- reconcile: dead-lettered rollout tasks -> failed attempts, recorded as run events; after Redis lost its
  data, a replay of `results.accepted` from Postgres (_replay_if_redis_lost).
- trim: acknowledged entries of the streams the controller reads or writes.
"""

from __future__ import annotations

import asyncio
import json
import time

from prometheus_client import Counter, Gauge, Histogram
from pydantic import ValidationError
from redis.exceptions import RedisError, ResponseError
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from services.controller import ledger
from services.controller.config import ControllerConfig
from services.controller.run import RunDriver
from services.controller.share import fair_shares
from shared.bus import REDIS_DOWN, Delivery, StreamBus, StreamConsumer
from shared.db.models import TERMINAL_RUN_STATUSES
from shared.db.session import DB_DOWN
from shared.ledger import ledger_summary
from shared.logs import get_logger
from shared.messages import (
    AcceptedResult,
    EpisodeResult,
    RolloutTask,
    TrainerProgress,
)
from shared.passk import pass_at_k_table
from shared.run_config import RunConfig
from shared.service import sleep_or_stop
from shared.store import TrajectoryStore, load_results
from shared.streams import (
    ACCEPTED_RESULTS,
    GROUP_CONTROLLER,
    GROUP_ROLLOUT,
    GROUP_STORE,
    ROLLOUT_TASKS,
    TRAINER_PROGRESS,
    TRAJECTORIES,
    dead_letter,
    epoch_key,
    heartbeat_key,
)

log = get_logger(__name__)

DISPATCHED = Counter("controller_tasks_dispatched_total", "Rollout tasks put on rollout.tasks")
STORED = Counter("controller_results_stored_total", "Completed results stored")
FAILED = Counter("controller_results_failed_total", "Failed attempts recorded")
LOST = Counter("controller_tasks_lost_total", "Dispatched tasks whose lease expired without a result")
LATE = Counter("controller_late_results_total", "Results from attempts no longer live (not stored)")
FINAL_FAILURES = Counter("controller_final_failures_total", "(task, sample) slots out of attempts")
IN_FLIGHT = Gauge("controller_in_flight", "Dispatched and unfinished tasks", ["run_id"])
DISPATCH_LATENCY = Histogram("controller_dispatch_latency_seconds", "Ledger insert + XADD of one dispatch pass")
DLQ_GROUP = GROUP_CONTROLLER


class Controller:
    def __init__(self, cfg: ControllerConfig, worker_id: str, engine: Engine, bus: StreamBus):
        self.cfg, self.worker_id, self.engine, self.bus = cfg, worker_id, engine, bus
        self.store = TrajectoryStore(engine, cfg.store_method)
        self.drivers: dict[str, RunDriver] = {}
        self.limits: dict[str, int] = {}  # run id -> in-flight limit under the shared capacity (share.py)
        self.live_concurrency = 0  # rollout slots the live workers advertise (heartbeats), refreshed every poll
        self.wake = asyncio.Event()
        self.status: dict = {}

    def loops(self, stop: asyncio.Event) -> list:
        return [self.drive(stop), self.store_results(stop), self.track_trainer(stop), self.reconcile(stop),
                self.trim(stop)]

    async def close(self) -> None:
        await asyncio.to_thread(self._tx, ledger.release_runs, self.worker_id)

    def _tx(self, fn, *args, **kw):
        with self.engine.begin() as conn:
            return fn(conn, *args, **kw)

    # -- drive ---------------------------------------------------------------------------------------------------
    async def drive(self, stop: asyncio.Event) -> None:
        next_poll = next_expire = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() >= next_poll:
                    await self.poll_runs()
                    self.live_concurrency = await self._live_rollout_concurrency()
                    next_poll = time.monotonic() + self.cfg.poll_interval_s
                if time.monotonic() >= next_expire:
                    for driver in list(self.drivers.values()):
                        await self.expire(driver)
                    next_expire = time.monotonic() + self.cfg.reconcile_interval_s
            except DB_DOWN as e:  # Postgres unreachable: wait it out; leases are re-taken after
                log.warning("database unavailable: %r", e)
                await sleep_or_stop(stop, self.cfg.poll_interval_s)
                continue
            # Cleared before the pass, not after: results stored while it runs must wake the next one at once
            # (clearing afterwards lost those wake-ups, so slots idled up to dispatch_interval_s).
            self.wake.clear()
            self.limits = self._share_capacity()
            for driver in list(self.drivers.values()):
                await self.step(driver)
            try:
                await asyncio.wait_for(self.wake.wait(), self.cfg.dispatch_interval_s)
            except TimeoutError:
                pass

    def _share_capacity(self) -> dict[str, int]:
        """In-flight limits per run (empty: each run dispatches up to its own max_in_flight). The capacity is
        ROLLOUT_CAPACITY, else, once two or more runs dispatch, the live rollout workers' advertised
        MAX_CONCURRENCY: no more tasks in flight than slots, so a slow run's tasks can hold at most its share of
        them (a lone run keeps its own max_in_flight, which may exceed the slots to keep them busy)."""
        dispatching = {r: (d.cfg.priority, d.cfg.max_in_flight) for r, d in self.drivers.items()
                       if d.status in ("pending", "running")}
        capacity = self.cfg.rollout_capacity
        if capacity is None and len(dispatching) > 1 and self.live_concurrency:
            capacity = self.live_concurrency
        return {} if capacity is None else fair_shares(capacity, dispatching)

    async def _live_rollout_concurrency(self) -> int:
        """Sum of MAX_CONCURRENCY the live rollout workers advertise in their heartbeats (0 when unknown)."""
        redis = self.bus.redis
        try:
            keys = [k async for k in redis.scan_iter(match=heartbeat_key("rollout-worker", "*"), count=500)]
            values = await redis.mget(keys) if keys else []
        except RedisError:
            return self.live_concurrency
        total = 0
        for raw in values:
            try:
                total += int(json.loads(raw or b"{}").get("max_concurrency") or 0)
            except (ValueError, TypeError, AttributeError):
                continue
        return total

    async def poll_runs(self) -> None:
        """Renew/take leases; runs no longer returned (lease lost, finished elsewhere) are dropped."""
        rows = await asyncio.to_thread(
            self._tx, ledger.lease_runs, self.worker_id, self.cfg.run_lease_s, self.cfg.max_runs
        )
        seen = set()
        for row in rows:
            seen.add(row.id)
            driver = self.drivers.get(row.id)
            if driver is None:
                await self.take_run(row)
            else:
                driver.status, driver.policy_version = row.status, row.policy_version
        for run_id in set(self.drivers) - seen:
            self._drop(run_id)
        train = [d for d in self.drivers.values() if not d.plan.is_eval]
        if train:
            await asyncio.to_thread(self._tx, self._count_dropped, train)
        self.status["runs"] = self.health()

    @staticmethod
    def _count_dropped(conn, drivers: list[RunDriver]) -> None:
        """Groups the trainer consumed without a step widen the dispatch window, so dropped groups are refilled."""
        for d in drivers:
            d.dropped_groups = ledger.dropped_groups(conn, d.run_id, d.final_failed_groups())

    def _drop(self, run_id: str) -> None:
        self.drivers.pop(run_id, None)
        try:
            IN_FLIGHT.remove(run_id)
        except KeyError:
            pass

    async def take_run(self, row: ledger.RunRow) -> None:
        """Build a driver from config + dataset + ledger; a config that cannot run fails the run."""
        try:
            cfg = RunConfig.model_validate(row.config)
            driver = await asyncio.to_thread(self._tx, self._build_driver, row, cfg)
        except (ValidationError, ValueError) as e:
            log.warning("run %s cannot start: %s", row.id, e, extra={"run_id": row.id})
            await asyncio.to_thread(self._tx, ledger.set_status, row.id, row.status, "failed", error=str(e))
            return
        self.drivers[row.id] = driver
        await self._announce_final_failures(driver)
        IN_FLIGHT.labels(row.id).set(len(driver.in_flight))
        log.info("driving run %s (%s, %d in flight, %d completed)", row.id, row.status, len(driver.in_flight),
                 driver.num_completed, extra={"run_id": row.id})

    def _build_driver(self, conn, row: ledger.RunRow, cfg: RunConfig) -> RunDriver:
        tasks = ledger.load_tasks(conn, cfg.dataset, cfg.dataset_split, cfg.dataset_version, cfg.max_tasks)
        driver = RunDriver(row, cfg, tasks)
        driver.rebuild(ledger.ledger_rows(conn, row.id))
        if not driver.plan.is_eval:
            self._count_dropped(conn, [driver])
        for task_id, sample_idx in driver.final_failed:  # in case we crashed before recording them
            self._final_failure_event(conn, driver, task_id, sample_idx, driver.states[(task_id, sample_idx)].attempt)
        return driver

    async def step(self, d: RunDriver) -> None:
        if d.status == "stopping" and d.withdrawn is None:
            d.withdrawn = await self._withdraw_queued(d.run_id)
        started = time.perf_counter()
        stored_here, d.stored_here = d.stored_here, []
        try:
            tasks = await asyncio.to_thread(self._tx, self._step_sync, d, stored_here)
        except SQLAlchemyError as e:  # the transaction rolled back: our in-memory view may be ahead of it
            log.warning("dispatch pass failed, rebuilding from the ledger: %r", e, extra={"run_id": d.run_id})
            self._drop(d.run_id)
            return
        if d.status in TERMINAL_RUN_STATUSES or d.stale:
            self._drop(d.run_id)  # finished, or the ledger changed under us: rebuilt at the next poll
        await self._announce_final_failures(d)
        if tasks:
            try:
                await self.bus.publish_many(ROLLOUT_TASKS, tasks)
            except RedisError as e:  # ledger rows stay dispatched; reconciliation re-dispatches them
                log.warning("publish of %d tasks failed: %r", len(tasks), e, extra={"run_id": d.run_id})
                return
            DISPATCHED.inc(len(tasks))
            DISPATCH_LATENCY.observe(time.perf_counter() - started)
        IN_FLIGHT.labels(d.run_id).set(len(d.in_flight))

    def _step_sync(self, conn, d: RunDriver, stored_here: list[tuple]) -> list[RolloutTask]:
        # Results our own store loop committed are applied as they come; the ledger itself (results other
        # controllers stored, dead-lettered tasks) is read every poll_interval_s. Reading it on every pass
        # cost a query per pass that grew with the run.
        for ended in stored_here:
            self._ended(conn, d, *ended)
        if d.recount_dropped and not d.plan.is_eval:  # the trainer reported drops: refill them now
            d.recount_dropped = False
            self._count_dropped(conn, [d])
        if time.monotonic() >= d.next_ledger_scan:
            d.next_ledger_scan = time.monotonic() + self.cfg.poll_interval_s
            for task_id, sample_idx, attempt, status, error in ledger.ended_among(conn, d.run_id,
                                                                                 d.in_flight_keys()):
                self._ended(conn, d, task_id, sample_idx, attempt, status, error)
        if d.fail_reason and d.status in ("pending", "running", "paused"):
            self._fail(conn, d)
            return []
        if d.status == "pending" and ledger.set_status(conn, d.run_id, "pending", "running"):
            d.status = "running"
        if d.status == "stopping":
            self._stopping(conn, d)
        if d.status != "running":
            return []
        if d.is_done:
            self._complete(conn, d)
            return []
        return self._dispatch(conn, d)

    def _ended(self, conn, d: RunDriver, task_id: str, sample_idx: int, attempt: int, status: str,
               error: str | None = None) -> None:
        if d.apply(task_id, sample_idx, attempt, status, error):
            FINAL_FAILURES.inc()
            self._final_failure_event(conn, d, task_id, sample_idx, attempt)

    def _final_failure_event(self, conn, d: RunDriver, task_id: str, sample_idx: int, attempt: int) -> None:
        ledger.add_event(conn, d.run_id, "final_failure", f"{task_id}/{sample_idx} is out of attempts ({attempt + 1})",
                         {"task_id": task_id, "sample_idx": sample_idx, "attempt": attempt}, once=True)
        if not d.plan.is_eval:  # published once the transaction commits (_announce_final_failures)
            slot = d.states[(task_id, sample_idx)].slot
            d.notices.append(AcceptedResult(run_id=d.run_id, task_id=task_id, sample_idx=sample_idx,
                                            attempt=attempt, batch_idx=slot.batch_idx, greedy=slot.greedy))

    async def _announce_final_failures(self, d: RunDriver) -> None:
        """Tell the trainer which slots are out of attempts (their groups can never complete). Called after the
        events committed; a notice that cannot be published now is tried again at the next pass, and a
        controller that crashed first re-announces every final failure when it rebuilds the run."""
        if not d.notices:
            return
        notices, d.notices = d.notices, []
        try:
            await self.bus.publish_many(ACCEPTED_RESULTS, notices)
        except RedisError as e:
            log.warning("final-failure notices not published yet: %r", e, extra={"run_id": d.run_id})
            d.notices = notices + d.notices

    def _dispatch(self, conn, d: RunDriver) -> list[RolloutTask]:
        # max(0): a share that shrank (another run started) leaves this run over its limit for a while
        limit = self.limits.get(d.run_id, 0) if self.limits else d.cfg.max_in_flight
        items = d.next_items(max(0, limit - len(d.in_flight)))
        if not items:
            return []
        lease_s = d.cfg.trajectory_timeout_s + self.cfg.ledger_lease_margin_s
        inserted = ledger.insert_dispatched(conn, d.run_id, items, d.policy_version, lease_s)
        d.mark_dispatched(items, inserted)
        if len(inserted) < len(items):  # someone else dispatched some of these: re-read the ledger next poll
            log.warning("%d slots were already in the ledger", len(items) - len(inserted), extra={"run_id": d.run_id})
            d.stale = True
        # The ledger's lease started at Postgres' now() in the insert above, so now + lease_s is no earlier than
        # it (up to clock skew): a worker that skips the task past this time skips only what the ledger expires.
        now = time.time()
        return [
            RolloutTask(run_id=d.run_id, task_id=s.task_id, sample_idx=s.sample_idx, attempt=a,
                        task=d.task_data[s.task_id], batch_idx=s.batch_idx, dispatch_version=d.policy_version,
                        greedy=s.greedy, dispatched_at=now, deadline_s=d.cfg.trajectory_timeout_s,
                        lease_expires_at=now + lease_s)
            for s, a in items if (s.task_id, s.sample_idx, a) in inserted
        ]

    def _stopping(self, conn, d: RunDriver) -> None:
        """Stop dispatching; cancel the tasks taken back from the stream (no worker had started them); wait for
        the others up to stop_timeout_s, then cancel and record them."""
        if d.withdrawn:
            keys = ledger.cancel_dispatched(conn, d.run_id, d.withdrawn, "run stopped before a worker took the task")
            d.withdrawn = []
            for key in keys:
                self._ended(conn, d, *key, "cancelled")
            if keys:
                ledger.add_event(conn, d.run_id, "cancelled", f"{len(keys)} queued tasks withdrawn at stop",
                                 {"count": len(keys), "queued": True})
        d.stopping_since = d.stopping_since or time.monotonic()
        if d.in_flight and time.monotonic() - d.stopping_since < self.cfg.stop_timeout_s:
            return
        cancelled = ledger.cancel_in_flight(conn, d.run_id)
        if cancelled:
            ledger.add_event(conn, d.run_id, "cancelled", f"{cancelled} in-flight tasks cancelled at stop",
                             {"count": cancelled})
        if ledger.set_status(conn, d.run_id, "stopping", "stopped"):
            d.status = "stopped"

    def _fail(self, conn, d: RunDriver) -> None:
        """Fail fast (RunDriver._track_failures): stop dispatching, cancel what is in flight, and say why."""
        cancelled = ledger.cancel_in_flight(conn, d.run_id)
        if ledger.set_status(conn, d.run_id, d.status, "failed", error=d.fail_reason):
            log.warning("run failed: %s (%d in-flight tasks cancelled)", d.fail_reason, cancelled,
                        extra={"run_id": d.run_id})
            d.status = "failed"

    def _complete(self, conn, d: RunDriver) -> None:
        summary = {"ledger": ledger_summary(conn, d.run_id), "final_failures": len(d.final_failed)}
        metrics: dict[str, float] = {}
        if d.plan.is_eval:
            table = pass_at_k_table(ledger.eval_samples(conn, d.run_id, d.cfg.dataset, d.cfg.dataset_split,
                                                          d.cfg.dataset_version))
            summary.update(table)
            metrics = {f"eval/pass@{k}": v for k, v in table["pass@k"].items()}
            for src, t in table["by_source"].items():
                metrics.update({f"eval/pass@{k}/{src}": v for k, v in t["pass@k"].items()})
        ledger.write_summary(conn, d.run_id, summary, metrics)
        if ledger.set_status(conn, d.run_id, "running", "completed"):
            d.status = "completed"

    async def _withdraw_queued(self, run_id: str) -> list[tuple[str, int, int]]:
        """Stopped means no more work: delete the run's tasks that no rollout worker has read yet from
        `rollout.tasks` (those after the group's last-delivered id) and return their keys, to cancel. A task a
        worker reads in between still runs; its result arrives after the cancel and is a late result."""
        try:
            tasks = await self.bus.withdraw_unread(ROLLOUT_TASKS, GROUP_ROLLOUT, RolloutTask,
                                                   lambda t: t.run_id == run_id)
            return [(t.task_id, t.sample_idx, t.attempt) for t in tasks]
        except RedisError as e:  # then they are cancelled at the stop timeout instead
            log.warning("could not withdraw queued tasks: %r", e, extra={"run_id": run_id})
            return []

    # -- store ---------------------------------------------------------------------------------------------------
    async def store_results(self, stop: asyncio.Event) -> None:
        consumer = StreamConsumer(
            self.bus, TRAJECTORIES, GROUP_STORE, self.worker_id, expect=EpisodeResult,
            batch_size=self.cfg.store_batch_size, claim_idle_ms=self.cfg.store_claim_idle_ms,
            on_dead_letter=self._store_dead_letter, transient=(*DB_DOWN, *REDIS_DOWN),
        )
        await consumer.run(self._store_batch, stop)

    async def _store_batch(self, deliveries: list[Delivery]) -> None:
        """Store, then hand what the store accepted to the trainer, then (on return) ack `trajectories`. A crash
        or Redis error between the commit and the publish re-delivers the entries; the store then reports them
        as stored again (`to_train`) and they are published then."""
        out = await asyncio.to_thread(self.store.write, [d.message for d in deliveries])
        if out.to_train:
            await self.bus.publish_many(ACCEPTED_RESULTS, [AcceptedResult.stored(r) for r in out.to_train])
        errors = {d.message.key: d.message.error for d in deliveries}
        for (run_id, task_id, sample_idx, attempt), status in out.ended:
            driver = self.drivers.get(run_id)
            if driver is not None:
                driver.stored_here.append((task_id, sample_idx, attempt, status,
                                           errors.get((run_id, task_id, sample_idx, attempt))))
        STORED.inc(out.stored)
        FAILED.inc(out.failed)
        LATE.inc(len(out.late))
        self.wake.set()

    async def _store_dead_letter(self, delivery: Delivery | None, entry_id: bytes, reason: str) -> None:
        if delivery is None or not isinstance(delivery.message, EpisodeResult):
            log.error("undecodable trajectories entry %s dead-lettered: %s", entry_id, reason)
            return
        msg = delivery.message
        await asyncio.to_thread(
            self._tx, ledger.add_event, msg.run_id, "dead_lettered",
            f"trajectories entry {entry_id.decode()} could not be stored: {reason[-2000:]}",
            {"stream": TRAJECTORIES, "task_id": msg.task_id, "sample_idx": msg.sample_idx, "attempt": msg.attempt},
        )

    # -- progress ------------------------------------------------------------------------------------------------
    async def track_trainer(self, stop: asyncio.Event) -> None:
        consumer = StreamConsumer(self.bus, TRAINER_PROGRESS, GROUP_CONTROLLER, self.worker_id,
                                  expect=TrainerProgress, claim_idle_ms=self.cfg.store_claim_idle_ms,
                                  transient=DB_DOWN)
        await consumer.run(self._record_progress, stop)

    async def _record_progress(self, deliveries: list[Delivery]) -> None:
        msgs = [d.message for d in deliveries]
        await asyncio.to_thread(self._tx, ledger.record_progress, msgs)
        for m in msgs:  # runs we drive see it at once; others at their controller's next poll
            driver = self.drivers.get(m.run_id)
            if driver is not None:
                driver.policy_version = max(driver.policy_version, m.version)
                driver.recount_dropped = driver.recount_dropped or bool(m.groups)
        self.wake.set()

    # -- reconcile -----------------------------------------------------------------------------------------------
    async def reconcile(self, stop: asyncio.Event) -> None:
        """Dead-lettered rollout tasks (lease expiry runs inside the drive loop, which owns the drivers)."""
        dead_tasks = StreamConsumer(self.bus, dead_letter(ROLLOUT_TASKS), DLQ_GROUP, self.worker_id,
                                    expect=RolloutTask, batch_size=100, block_ms=None, transient=DB_DOWN,
                                    on_dead_letter=self._unrecordable_task_dead_letter)
        await dead_tasks.start()
        while not stop.is_set():
            try:
                await self._replay_if_redis_lost()
                await dead_tasks.process(self._record_task_dead_letters, await dead_tasks.read())
            except (RedisError, *DB_DOWN) as e:
                log.warning("dead-letter scan or replay failed: %r", e)
            await sleep_or_stop(stop, self.cfg.reconcile_interval_s)

    async def _replay_if_redis_lost(self) -> None:
        """Redis lost its data (the epoch key is gone): `results.accepted` may have lost results the store had
        accepted, and notices of slots out of attempts, that the trainer never read. Nothing would send them
        again, so their groups would wait forever: publish them again from Postgres (every stored group the
        trainer has not reported consuming), then set the key. Duplicates are harmless to the trainer, and a
        crash before the key is set just replays again."""
        if await self.bus.redis.exists(epoch_key()):
            return
        for run_id in await asyncio.to_thread(self._tx, ledger.active_train_runs):
            msgs = await asyncio.to_thread(self._tx, self._unconsumed, run_id)
            for i in range(0, len(msgs), 100):
                await self.bus.publish_many(ACCEPTED_RESULTS, msgs[i:i + 100])
            if msgs:
                log.warning("Redis lost its data: replayed %d accepted results and notices", len(msgs),
                            extra={"run_id": run_id})
        await self.bus.redis.set(epoch_key(), self.worker_id)

    @staticmethod
    def _unconsumed(conn, run_id: str) -> list[AcceptedResult]:
        groups = ledger.unconsumed_groups(conn, run_id)
        results = [AcceptedResult.stored(r) for r in load_results(conn, run_id, groups)] if groups else []
        return results + [AcceptedResult(run_id=run_id, task_id=t, sample_idx=s, attempt=a, batch_idx=b, greedy=g)
                          for t, s, a, b, g in ledger.final_failures(conn, run_id)]

    async def expire(self, d: RunDriver) -> None:
        try:
            await asyncio.to_thread(self._tx, self._expire, d)
        except SQLAlchemyError as e:  # rolled back after we updated memory: rebuild from the ledger
            log.warning("lease expiry pass failed: %r", e, extra={"run_id": d.run_id})
            self._drop(d.run_id)
            return
        await self._announce_final_failures(d)

    def _expire(self, conn, d: RunDriver) -> None:
        lost = ledger.expire_leases(conn, d.run_id)
        if not lost:
            return
        LOST.inc(len(lost))
        ledger.add_event(conn, d.run_id, "lost", f"{len(lost)} dispatched tasks had no result before their lease",
                         {"count": len(lost), "keys": [list(k) for k in lost[:100]]})
        for key in lost:
            self._ended(conn, d, *key, "lost", "no result before the task lease expired")
        self.wake.set()

    async def _record_task_dead_letters(self, deliveries: list[Delivery]) -> None:
        """Rollout tasks the rollout workers dead-lettered: that attempt failed (retried while attempts remain)."""
        for d in deliveries:
            await asyncio.to_thread(self._tx, self._record_task_dead_letter, d.message,
                                    d.fields.get(b"dlq_reason", b"").decode(errors="replace"))

    @staticmethod
    async def _unrecordable_task_dead_letter(delivery: Delivery | None, entry_id: bytes, reason: str) -> None:
        log.error("dead-lettered rollout task %s could not be recorded (moved on to %s): %s", entry_id,
                  dead_letter(dead_letter(ROLLOUT_TASKS)), reason)

    def _record_task_dead_letter(self, conn, task: RolloutTask, reason: str) -> None:
        if ledger.fail_dispatched(conn, task.run_id, (task.task_id, task.sample_idx, task.attempt), reason):
            ledger.add_event(conn, task.run_id, "dead_lettered", f"rollout task dead-lettered: {reason[-2000:]}",
                             {"stream": ROLLOUT_TASKS, "task_id": task.task_id, "sample_idx": task.sample_idx,
                              "attempt": task.attempt})

    # -- trim ----------------------------------------------------------------------------------------------------
    async def trim(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await sleep_or_stop(stop, self.cfg.trim_interval_s)
            for stream in (ROLLOUT_TASKS, TRAJECTORIES, ACCEPTED_RESULTS, TRAINER_PROGRESS):
                try:
                    await self.bus.trim_acknowledged(stream)
                except (RedisError, ResponseError) as e:
                    log.warning("trim of %s failed: %r", stream, e)

    def health(self) -> dict:
        return {rid: {"status": d.status, "in_flight": len(d.in_flight), "completed": d.num_completed,
                      "policy_version": d.policy_version} for rid, d in self.drivers.items()}

