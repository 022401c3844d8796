"""The reconcile loop, every reconcile_interval_s: rollout tasks the rollout workers dead-lettered become
failed attempts (retried while attempts remain), recorded as run events; and after Redis lost its data, what
the trainer never read is published again from Postgres (`replay_if_redis_lost`). Lease expiry is not here:
it changes the drivers, which the dispatch loop owns (dispatch.py)."""

from __future__ import annotations

import asyncio
import uuid

from sqlalchemy import Engine

from services.controller import ledger, run_rows, trainer_groups
from services.controller.settings import ControllerSettings
from services.controller.store import load_results
from shared.contracts.messages import AcceptedResult, RolloutTask
from shared.contracts.streams import ACCEPTED_RESULTS, GROUP_CONTROLLER, ROLLOUT_TASKS, dead_letter, epoch_key
from shared.platform.bus import Delivery, RedisError, StreamBus, StreamConsumer
from shared.platform.db.session import DB_DOWN
from shared.platform.logs import get_logger
from shared.platform.service import sleep_or_stop

log = get_logger(__name__)

REPLAYING = b"replaying:"
# Done only if the key still holds this replay's token (nothing wiped or took it over meanwhile).
_SET_IF_HELD = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2]) end"


class ReconcileLoop:
    def __init__(self, cfg: ControllerSettings, worker_id: str, db: Engine, bus: StreamBus):
        self.cfg, self.worker_id, self.db, self.bus = cfg, worker_id, db, bus
        self.dead_tasks = StreamConsumer(bus, dead_letter(ROLLOUT_TASKS), GROUP_CONTROLLER, worker_id,
                                         expect=RolloutTask, batch_size=100, block_ms=None, transient=DB_DOWN,
                                         on_dead_letter=self.unrecordable)

    async def run(self, stop: asyncio.Event) -> None:
        await self.dead_tasks.start()
        while not stop.is_set():
            try:
                await self.replay_if_redis_lost()
                await self.dead_tasks.process(self.record_dead_tasks, await self.dead_tasks.read())
            except (RedisError, *DB_DOWN) as e:
                log.warning("dead-letter scan or replay failed: %r", e)
            await sleep_or_stop(stop, self.cfg.reconcile_interval_s)

    async def record_dead_tasks(self, deliveries: list[Delivery]) -> None:
        """Rollout tasks the rollout workers dead-lettered: that attempt failed (retried as attempt+1 while
        attempts remain; the dispatch loop reads the ended row from the ledger)."""
        for d in deliveries:
            await asyncio.to_thread(self.fail_attempt, d.message,
                                    d.fields.get(b"dlq_reason", b"").decode(errors="replace"))

    def fail_attempt(self, task: RolloutTask, reason: str) -> None:
        with self.db.begin() as conn:
            if ledger.fail_dispatched(conn, task.run_id, (task.task_id, task.sample_idx, task.attempt), reason):
                run_rows.add_event(conn, task.run_id, "dead_lettered", f"rollout task dead-lettered: {reason[-2000:]}",
                                  {"stream": ROLLOUT_TASKS, "task_id": task.task_id, "sample_idx": task.sample_idx,
                                   "attempt": task.attempt})

    @staticmethod
    async def unrecordable(delivery: Delivery | None, entry_id: bytes, reason: str) -> None:
        log.error("dead-lettered rollout task %s could not be recorded (moved on to %s): %s", entry_id,
                  dead_letter(dead_letter(ROLLOUT_TASKS)), reason)

    async def replay_if_redis_lost(self) -> None:
        """Redis lost its data (the epoch key is gone): `results.accepted` may have lost results the store had
        accepted, and notices of slots out of attempts, that the trainer never read. Nothing would send them
        again, so their groups would wait forever: publish them again from Postgres (every stored group the
        trainer has not reported consuming). The key says `replaying:<token>` meanwhile and becomes done only if
        it still holds that token: Redis losing its data again during a replay (which reads the runs one by one,
        seconds with many runs) wipes the token and the next pass replays again, as does a crash mid-replay.
        Duplicates are harmless to the trainer."""
        state = await self.bus.redis.get(epoch_key())
        if state is not None and not state.startswith(REPLAYING):
            return
        token = REPLAYING + f"{self.worker_id}:{uuid.uuid4().hex}".encode()
        await self.bus.redis.set(epoch_key(), token)
        for run_id in await asyncio.to_thread(run_rows.active_train_runs, self.db):
            msgs = await asyncio.to_thread(self.unconsumed, run_id)
            for i in range(0, len(msgs), 100):
                await self.bus.publish_many(ACCEPTED_RESULTS, msgs[i:i + 100])
            if msgs:
                log.warning("Redis lost its data: replayed %d accepted results and notices", len(msgs),
                            extra={"run_id": run_id})
        if not await self.bus.redis.eval(_SET_IF_HELD, 1, epoch_key(), token, self.worker_id):
            log.warning("Redis lost its data again during the replay: replaying again")

    def unconsumed(self, run_id: str) -> list[AcceptedResult]:
        """The accepted results of the run's groups the trainer has not reported consuming, and the notices of
        its slots out of attempts or errored."""
        with self.db.connect() as conn:
            groups = trainer_groups.unconsumed_groups(conn, run_id)
            results = [AcceptedResult.stored(r) for r in load_results(conn, run_id, groups)] if groups else []
            return results + [AcceptedResult(run_id=run_id, task_id=t, sample_idx=s, attempt=a, batch_idx=b,
                                             greedy=g)
                              for t, s, a, b, g in trainer_groups.final_failures(conn, run_id)]
