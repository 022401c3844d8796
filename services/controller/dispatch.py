"""The dispatch loop: the one loop that owns the run drivers (run.py).

Every poll_interval_s: renew or take run leases, refresh the rollout capacity, say why a run stalls; then per
run one pass in one transaction (`dispatch_pass`): apply ledger rows that ended, move the run's status,
dispatch into the window (ledger rows first, then XADD; the rows a controller died before publishing are
published by the one that takes the run over). A slot out of attempts of a training run is announced
on `results.accepted` after its `final_failure` event commits. Every reconcile_interval_s, dispatched tasks
whose lease expired are marked lost (re-dispatched as attempt+1 while attempts remain).

More: docs/architecture.md#dispatch
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Gauge, Histogram
from pydantic import ValidationError
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from services.controller import dataset_rows, ledger, lifecycle, run_rows, run_summary, trainer_groups
from services.controller.plan import Slot
from services.controller.run_driver import RunDriver
from services.controller.settings import ControllerSettings
from services.controller.share import fair_shares
from services.controller.stall import gather_facts, stall_reason
from shared.contracts.db.models import TERMINAL_RUN_STATUSES
from shared.contracts.messages import RolloutTask
from shared.contracts.run_config import RunConfig
from shared.contracts.streams import ACCEPTED_RESULTS, GROUP_ROLLOUT, ROLLOUT_TASKS
from shared.platform import tracing
from shared.platform.bus import RedisError, StreamBus
from shared.platform.db.session import DB_DOWN
from shared.platform.heartbeats import live_workers_async
from shared.platform.logs import get_logger
from shared.platform.service import sleep_or_stop, wait_for

log = get_logger(__name__)
DISPATCHED = Counter("controller_tasks_dispatched_total", "Rollout tasks put on rollout.tasks")
LOST = Counter("controller_tasks_lost_total", "Dispatched tasks whose lease expired without a result")
IN_FLIGHT = Gauge("controller_in_flight", "Dispatched and unfinished tasks", ["run_id"])
DISPATCH_LATENCY = Histogram("controller_dispatch_latency_seconds", "Ledger insert + XADD of one dispatch pass")


class DispatchLoop:
    def __init__(self, cfg: ControllerSettings, worker_id: str, db: Engine, bus: StreamBus,
                 drivers: dict[str, RunDriver], wake: asyncio.Event, status: dict):
        self.cfg, self.worker_id, self.db, self.bus = cfg, worker_id, db, bus
        self.drivers, self.wake, self.status = drivers, wake, status
        self.limits: dict[str, int] = {}  # run id -> in-flight limit under the shared capacity (share.py)
        self.live_concurrency = 0  # rollout slots the live workers advertise (heartbeats), refreshed every poll

    async def run(self, stop: asyncio.Event) -> None:
        next_poll = next_expire = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() >= next_poll:
                    await self.poll_runs()
                    self.live_concurrency = await self.live_rollout_concurrency()
                    await self.check_stalls()
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
            self.limits = self.share_capacity()
            for driver in list(self.drivers.values()):
                await self.step(driver)
            try:
                await wait_for(self.wake.wait(), self.cfg.dispatch_interval_s)
            except TimeoutError:
                pass

    # -- runs: leases, drivers -------------------------------------------------------------------------------
    async def poll_runs(self) -> None:
        """Renew/take leases; runs no longer returned (lease lost, finished elsewhere) are dropped."""
        rows = await asyncio.to_thread(run_rows.lease_runs, self.db, self.worker_id, self.cfg.run_lease_s,
                                       self.cfg.max_runs)
        seen = set()
        for row in rows:
            seen.add(row.id)
            driver = self.drivers.get(row.id)
            if driver is None:
                await self.take_run(row)
            else:
                if row.policy_version != driver.policy_version:
                    driver.last_progress = time.monotonic()
                if row.status_version >= driver.status_version:  # a newer run.control already applied stays
                    driver.status, driver.status_version = row.status, row.status_version
                driver.policy_version = row.policy_version
        for run_id in set(self.drivers) - seen:
            self.drop(run_id)
        train = [d for d in self.drivers.values() if not d.plan.is_eval]
        if train:
            await asyncio.to_thread(self.count_dropped, train)
        self.status["runs"] = self.health()

    def count_dropped(self, drivers: list[RunDriver]) -> None:
        with self.db.connect() as conn:
            for d in drivers:
                count_dropped(conn, d)

    def drop(self, run_id: str) -> None:
        self.drivers.pop(run_id, None)
        try:
            IN_FLIGHT.remove(run_id)
        except KeyError:
            pass

    async def take_run(self, row: run_rows.RunRow) -> None:
        """Build a driver from config + dataset + ledger; a config that cannot run fails the run."""
        try:
            cfg = RunConfig.model_validate(row.config)
            driver = await asyncio.to_thread(self.load_driver, row, cfg)
        except (ValidationError, ValueError) as e:
            log.warning("run %s cannot start: %s", row.id, e, extra={"run_id": row.id})
            await asyncio.to_thread(run_rows.fail_run, self.db, row.id, row.status, str(e))
            return
        driver.last_progress = time.monotonic()
        self.drivers[row.id] = driver
        await self.announce_final_failures(driver)
        IN_FLIGHT.labels(row.id).set(len(driver.in_flight))
        log.info("driving run %s (%s, %d in flight, %d completed)", row.id, row.status, len(driver.in_flight),
                 driver.num_completed, extra={"run_id": row.id})

    def load_driver(self, row: run_rows.RunRow, cfg: RunConfig) -> RunDriver:
        """The run's state rebuilt from its dataset and ledger; final failures recorded (in case a controller
        crashed before recording them) and announced again, like errored slots."""
        with self.db.begin() as conn:
            tasks = dataset_rows.load_tasks(conn, cfg.dataset, cfg.dataset_split, cfg.dataset_version,
                                            cfg.max_tasks)
            driver = RunDriver(row, cfg, tasks)
            driver.rebuild(ledger.ledger_rows(conn, row.id))
            if not driver.plan.is_eval:
                count_dropped(conn, driver)
            for task_id, sample_idx in driver.final_failed:
                lifecycle.final_failure_event(conn, driver, task_id, sample_idx,
                                              driver.states[(task_id, sample_idx)].attempt)
            for task_id, sample_idx in driver.errored:
                lifecycle.group_cannot_complete(driver, task_id, sample_idx,
                                                driver.states[(task_id, sample_idx)].attempt)
            lease_s = cfg.trajectory_timeout_s + self.cfg.ledger_lease_margin_s
            driver.unpublished = [rollout_task(driver, driver.states[(t, s)].slot, a, v, lease_s)
                                  for t, s, a, v in ledger.take_unpublished(conn, row.id, lease_s)]
        return driver

    # -- one pass per run ------------------------------------------------------------------------------------
    async def step(self, d: RunDriver) -> None:
        if d.status == "stopping" and d.withdrawn is None:
            d.withdrawn = await self.withdraw_queued(d.run_id)
        started = time.perf_counter()
        stored_here, d.stored_here = d.stored_here, []
        try:
            tasks = await asyncio.to_thread(self.dispatch_pass, d, stored_here)
        except SQLAlchemyError as e:  # the transaction rolled back: our in-memory view may be ahead of it
            log.warning("dispatch pass failed, rebuilding from the ledger: %r", e, extra={"run_id": d.run_id})
            self.drop(d.run_id)
            return
        if d.status in TERMINAL_RUN_STATUSES or d.stale:
            self.drop(d.run_id)  # finished, or the ledger changed under us: rebuilt at the next poll
        await self.announce_final_failures(d)
        if await self.publish(d, tasks):
            DISPATCHED.inc(len(tasks))
            DISPATCH_LATENCY.observe(time.perf_counter() - started)
        IN_FLIGHT.labels(d.run_id).set(len(d.in_flight))

    async def publish(self, d: RunDriver, tasks: list[RolloutTask]) -> bool:
        """XADD the tasks just committed to the ledger, with those whose XADD failed before (still in flight);
        False if it fails again: they stay the driver's to publish at the next pass. The ledger learns at the
        next pass which were published; rows a dead controller never marked are published again by the one
        that takes the run over (`load_driver`), and the store keeps one result of a task run twice."""
        live = set(d.in_flight_keys()) if d.status in ("running", "paused") else set()  # a stopping run's are cancelled
        tasks = [t for t in d.unpublished if (t.task_id, t.sample_idx, t.attempt) in live] + tasks
        d.unpublished = []
        if not tasks:
            return False
        try:
            await self.bus.publish_many(ROLLOUT_TASKS, tasks)
        except RedisError as e:
            log.warning("publish of %d tasks failed, tried again next pass: %r", len(tasks), e,
                        extra={"run_id": d.run_id})
            d.unpublished = tasks
            return False
        d.published += [(t.task_id, t.sample_idx, t.attempt) for t in tasks]
        return True

    def dispatch_pass(self, d: RunDriver, stored_here: list[tuple]) -> list[RolloutTask]:
        """One transaction: apply what ended, move the run's status, insert the ledger rows of the tasks to
        publish (returned; published after the commit)."""
        with self.db.begin() as conn:
            ledger.mark_published(conn, d.run_id, d.published)
            d.published = []
            # Results our own store loop committed are applied as they come; the ledger itself (results other
            # controllers stored, dead-lettered tasks) is read every poll_interval_s. Reading it on every pass
            # cost a query per pass that grew with the run.
            for ended in stored_here:
                lifecycle.ended(conn, d, *ended)
            if d.recount_dropped and not d.plan.is_eval:  # the trainer reported drops: refill them now
                d.recount_dropped = False
                count_dropped(conn, d)
            if time.monotonic() >= d.next_ledger_scan:
                d.next_ledger_scan = time.monotonic() + self.cfg.poll_interval_s
                for ended in ledger.ended_among(conn, d.run_id, d.in_flight_keys()):
                    lifecycle.ended(conn, d, *ended)
            if d.fail_reason is None and d.nothing_scored():
                d.fail_reason = lifecycle.nothing_scored_reason(d, run_summary.top_reasons(conn, d.run_id))
            if d.fail_reason and d.status in ("pending", "running", "paused"):
                lifecycle.fail(conn, d)
                return []
            if d.status == "pending" and run_rows.set_status(conn, d.run_id, "pending", "running"):
                d.status = "running"
            if d.status == "stopping":
                lifecycle.stopping(conn, d, self.cfg.stop_timeout_s)
            if d.status != "running":
                return []
            if d.is_done:
                lifecycle.complete(conn, d)
                return []
            return self.insert_tasks(conn, d)

    def insert_tasks(self, conn: Connection, d: RunDriver) -> list[RolloutTask]:
        """The ledger rows of the next items the run may dispatch, and their tasks (only the rows inserted)."""
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
        return [rollout_task(d, s, a, d.policy_version, lease_s)
                for s, a in items if (s.task_id, s.sample_idx, a) in inserted]

    async def announce_final_failures(self, d: RunDriver) -> None:
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

    async def withdraw_queued(self, run_id: str) -> list[tuple[str, int, int]]:
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

    # -- lease expiry ----------------------------------------------------------------------------------------
    async def expire(self, d: RunDriver) -> None:
        try:  # what live workers are running: a slow trajectory of a working worker is not lost (renewed)
            held = [(k[1], k[2], k[3]) for w in await live_workers_async(self.bus.redis, "rollout-worker")
                    for k in w.holds if k[0] == d.run_id]
            held += await self.restamp_unread(d)
        except RedisError as e:  # cannot tell who holds what: expire nothing this time
            log.warning("lease expiry pass skipped, the rollout workers' heartbeats are unreadable: %r", e,
                        extra={"run_id": d.run_id})
            return
        try:
            await asyncio.to_thread(self.mark_lost, d, held)
        except SQLAlchemyError as e:  # rolled back after we updated memory: rebuild from the ledger
            log.warning("lease expiry pass failed: %r", e, extra={"run_id": d.run_id})
            self.drop(d.run_id)
            return
        await self.announce_final_failures(d)

    async def restamp_unread(self, d: RunDriver) -> list[tuple[str, int, int]]:
        """Tasks of the run still waiting in `rollout.tasks` (no worker has read them: the workers are busy) with
        less than half their lease left go back on the stream with a fresh lease, and their ledger rows are
        renewed with them (returned): a backlog on a loaded machine is slow, not lost. A worker that reads one
        between the scan and the delete runs it twice; the store keeps one."""
        lease_s = d.cfg.trajectory_timeout_s + self.cfg.ledger_lease_margin_s
        now = time.time()
        waiting = await self.bus.withdraw_unread(ROLLOUT_TASKS, GROUP_ROLLOUT, RolloutTask,
                                                 lambda t: t.run_id == d.run_id and t.lease_left(now) < lease_s / 2)
        if waiting:  # the ledger's lease, renewed after this in mark_lost, ends no earlier than these
            await self.bus.publish_many(ROLLOUT_TASKS, [t.model_copy(update={"lease_expires_at": now + lease_s})
                                                        for t in waiting])
        return [(t.task_id, t.sample_idx, t.attempt) for t in waiting]

    def mark_lost(self, d: RunDriver, held: list[tuple[str, int, int]]) -> None:
        """Dispatched rows past their lease are lost: recorded as such and retried while attempts remain. Those a
        live rollout worker says it runs (`held`, from its heartbeat) have their lease renewed instead."""
        with self.db.begin() as conn:
            lost = ledger.expire_leases(conn, d.run_id, held, d.cfg.trajectory_timeout_s + self.cfg.ledger_lease_margin_s)
            if not lost:
                return
            LOST.inc(len(lost))
            run_rows.add_event(conn, d.run_id, "lost", f"{len(lost)} dispatched tasks had no result before their "
                              "lease", {"count": len(lost), "keys": [list(k) for k in lost[:100]]})
            for key in lost:
                lifecycle.ended(conn, d, *key, "lost", "no result before the task lease expired")
        self.wake.set()

    # -- capacity, stalls ------------------------------------------------------------------------------------
    def share_capacity(self) -> dict[str, int]:
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

    async def live_rollout_concurrency(self) -> int:
        """Sum of MAX_CONCURRENCY the live rollout workers advertise in their heartbeats (the last sum while
        Redis cannot be read)."""
        try:
            beats = await live_workers_async(self.bus.redis, "rollout-worker")
        except RedisError:
            return self.live_concurrency
        return sum(beat.max_concurrency for beat in beats)

    async def check_stalls(self) -> None:
        """A running run with no attempt ended and no new policy version for its stall window says why in
        runs.stall_reason (stall.py: each reason detected, none guessed); cleared once it moves again. A paused
        run says it is paused. A training run whose groups all lacked learning signal for NO_SIGNAL_VERSIONS
        versions gets a warning."""
        now = time.monotonic()
        facts = None
        for d in list(self.drivers.values()):
            reason = None
            if d.status == "paused":
                reason = "paused: resume it (POST /v1/runs/{id}/resume, or `flywheel runs resume`)"
            elif d.status == "running" and now - d.last_progress >= (window := self.stall_window(d)):
                facts = facts or await gather_facts(self.bus.redis)
                reason = stall_reason(d, facts, window)
            if reason != d.stall_reason:
                await asyncio.to_thread(run_rows.set_stall, self.db, d.run_id, reason)
                if reason:
                    log.warning("run stalled: %s", reason, extra={"run_id": d.run_id})
                d.stall_reason = reason
            if not d.plan.is_eval and d.policy_version != d.signal_checked_version:
                d.signal_checked_version = d.policy_version
                warning = await asyncio.to_thread(run_rows.update_run_warning, self.db, d.run_id,
                                                  self.cfg.no_signal_versions)
                if warning:
                    log.warning("%s", warning, extra={"run_id": d.run_id})

    def stall_window(self, d: RunDriver) -> float:
        """STALL_AFTER_S, or twice the time a unit of this run takes now when that is longer: on a loaded machine
        every slot busy with slow trajectories is a slow run, not a stalled one (whole seconds: the reason's
        wording stays the same while the run stays stalled)."""
        return float(max(self.cfg.stall_after_s, round(2 * d.unit_s)))

    def health(self) -> dict:
        return {rid: {"status": d.status, "in_flight": len(d.in_flight), "completed": d.num_completed,
                      "policy_version": d.policy_version} for rid, d in self.drivers.items()}


def rollout_task(d: RunDriver, s: Slot, attempt: int, version: int, lease_s: float) -> RolloutTask:
    now = time.time()
    return RolloutTask(run_id=d.run_id, task_id=s.task_id, sample_idx=s.sample_idx, attempt=attempt,
                       task=d.task_data[s.task_id], batch_idx=s.batch_idx, dispatch_version=version,
                       greedy=s.greedy, dispatched_at=now, deadline_s=d.cfg.trajectory_timeout_s,
                       lease_expires_at=now + lease_s, traceparent=dispatch_span(d, s, attempt))


def dispatch_span(d: RunDriver, s: Slot, attempt: int) -> str | None:
    """The root span of one unit's trace (one attempt of a slot); its traceparent travels with the task."""
    with tracing.span("dispatch", root=True, run_id=d.run_id, task_id=s.task_id, sample_idx=s.sample_idx,
                      attempt=attempt, batch_idx=s.batch_idx, dispatch_version=d.policy_version):
        return tracing.traceparent()


def count_dropped(conn: Connection, d: RunDriver) -> None:
    """Groups the trainer consumed without a step widen the dispatch window, so dropped groups are refilled."""
    d.dropped_groups = trainer_groups.dropped_groups(conn, d.run_id, d.final_failed_groups())
