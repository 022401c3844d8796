"""The progress loop: group "controller" on `trainer.progress` -> runs.policy_version, `consumed_groups` and a
trainer's `trainer_error` events, acknowledged after the commit. All the controller knows of the trainer comes this way.
A trainer that cannot load a run fails it (the dispatch pass records the reason)."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import Engine

from services.controller import trainer_groups
from services.controller.run_driver import RunDriver
from services.controller.settings import ControllerSettings
from shared.contracts.messages import TrainerProgress
from shared.contracts.streams import GROUP_CONTROLLER, TRAINER_PROGRESS
from shared.platform.bus import Delivery, StreamBus, StreamConsumer
from shared.platform.db.session import DB_DOWN


class ProgressLoop:
    def __init__(self, cfg: ControllerSettings, worker_id: str, db: Engine, bus: StreamBus,
                 drivers: dict[str, RunDriver], wake: asyncio.Event):
        self.db, self.drivers, self.wake = db, drivers, wake
        self.consumer = StreamConsumer(bus, TRAINER_PROGRESS, GROUP_CONTROLLER, worker_id, expect=TrainerProgress,
                                       claim_idle_ms=cfg.store_claim_idle_ms, transient=DB_DOWN)

    async def run(self, stop: asyncio.Event) -> None:
        await self.consumer.run(self.record, stop)

    async def record(self, deliveries: list[Delivery]) -> None:
        msgs = [d.message for d in deliveries]
        await asyncio.to_thread(trainer_groups.record_progress, self.db, msgs)
        for m in msgs:  # runs we drive see it at once; others at their controller's next poll
            driver = self.drivers.get(m.run_id)
            if driver is not None:
                if m.version > driver.policy_version:
                    driver.last_progress = time.monotonic()
                driver.policy_version = max(driver.policy_version, m.version)
                driver.recount_dropped = driver.recount_dropped or bool(m.groups)
                if m.error is not None:
                    driver.trainer_error = m.error
                    # its model or checkpoint will not load: no retry would load it, so the run fails with why
                    driver.fail_reason = driver.fail_reason or f"the trainer cannot train this run: {m.error[:1000]}"
                elif m.version > 0:  # a trainer trains it now
                    driver.trainer_error = None
        self.wake.set()
