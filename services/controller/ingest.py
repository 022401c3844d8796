"""The store loop: group "store" on `trajectories` -> TrajectoryStore (store.py, the one place that decides
whether a result is accepted) -> the accepted completed results of training runs on `results.accepted` -> ack.
Any controller stores any run's results; the ledger rows it ended are handed to the run's driver when this
controller drives the run (others read them from the ledger at their next poll)."""

from __future__ import annotations

import asyncio

from prometheus_client import Counter
from sqlalchemy import Engine

from services.controller import run_rows
from services.controller.run_driver import RunDriver
from services.controller.settings import ControllerSettings
from services.controller.store import TrajectoryStore
from shared.contracts.messages import AcceptedResult, EpisodeResult
from shared.contracts.streams import ACCEPTED_RESULTS, GROUP_STORE, TRAJECTORIES
from shared.platform import tracing
from shared.platform.bus import REDIS_DOWN, Delivery, StreamBus, StreamConsumer
from shared.platform.db.session import DB_DOWN
from shared.platform.logs import get_logger

log = get_logger(__name__)
STORED = Counter("controller_results_stored_total", "Completed results stored")
FAILED = Counter("controller_results_failed_total", "Failed attempts recorded")
LATE = Counter("controller_late_results_total", "Results from attempts no longer live (not stored)")


class IngestLoop:
    def __init__(self, cfg: ControllerSettings, worker_id: str, db: Engine, bus: StreamBus,
                 drivers: dict[str, RunDriver], wake: asyncio.Event):
        self.db, self.bus, self.drivers, self.wake = db, bus, drivers, wake
        self.store = TrajectoryStore(db, cfg.store_method)
        self.consumer = StreamConsumer(
            bus, TRAJECTORIES, GROUP_STORE, worker_id, expect=EpisodeResult,
            batch_size=cfg.store_batch_size, claim_idle_ms=cfg.store_claim_idle_ms,
            on_dead_letter=self.dead_lettered, transient=(*DB_DOWN, *REDIS_DOWN),
        )

    async def run(self, stop: asyncio.Event) -> None:
        await self.consumer.run(self.store_batch, stop)

    async def store_batch(self, deliveries: list[Delivery]) -> None:
        """Store, then hand what the store accepted to the trainer, then (on return) ack `trajectories`. A crash
        or Redis error between the commit and the publish re-delivers the entries; the store then reports them
        as stored again (`to_train`) and they are published then."""
        spans = {d.message.key: tracing.start_span("store", d.message.traceparent, run_id=d.message.run_id,
                                                   status=d.message.status, batch=len(deliveries))
                 for d in deliveries}  # each unit's own span over the batch's one transaction
        try:
            out = await asyncio.to_thread(self.store.write, [d.message for d in deliveries])
            for key, _ in out.ended:
                spans[key].set_attribute("accepted", True)
        finally:
            for span in spans.values():
                span.end()
        if out.to_train:
            await self.bus.publish_many(ACCEPTED_RESULTS, [AcceptedResult.stored(r, tracing.traceparent(spans[r.key]))
                                                           for r in out.to_train])
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

    async def dead_lettered(self, delivery: Delivery | None, entry_id: bytes, reason: str) -> None:
        """A result that could not be stored is a `dead_lettered` run event (an undecodable entry only a log
        line: it names no run)."""
        if delivery is None or not isinstance(delivery.message, EpisodeResult):
            log.error("undecodable trajectories entry %s dead-lettered: %s", entry_id, reason)
            return
        await asyncio.to_thread(self.record_dead_letter, delivery.message, entry_id.decode(), reason)

    def record_dead_letter(self, msg: EpisodeResult, entry_id: str, reason: str) -> None:
        with self.db.begin() as conn:
            run_rows.add_event(conn, msg.run_id, "dead_lettered",
                              f"trajectories entry {entry_id} could not be stored: {reason[-2000:]}",
                              {"stream": TRAJECTORIES, "task_id": msg.task_id, "sample_idx": msg.sample_idx,
                               "attempt": msg.attempt})
