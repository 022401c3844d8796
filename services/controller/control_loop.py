"""The control loop: group "controller" on `run.control` -> a user's pause, resume or stop applied to the run's
driver at once (command_loop.py already changed `runs.status`; shared/contracts/messages/control.py), then the dispatch loop is
woken to act on it: a paused run dispatches nothing more, a stopping one takes back its queued tasks. Without
it the dispatch loop would learn of the change at its next poll of the runs table, which remains the fallback
(a command lost with Redis's data, one for a run another controller drives).

A command is applied only when it is newer than the driver's last read of the runs table (`status_read_at`,
against the `sent_at` of the controller that applied it) and the driver's status is one it starts from: one
read late, after that read or a later command, would otherwise undo a newer status until the next poll.
"""

from __future__ import annotations

import asyncio

from services.controller.run_driver import RunDriver
from services.controller.settings import ControllerSettings
from shared.contracts.messages import RunControl
from shared.contracts.streams import GROUP_CONTROLLER, RUN_CONTROL
from shared.platform.bus import Delivery, StreamBus, StreamConsumer
from shared.platform.logs import get_logger

log = get_logger(__name__)


class ControlLoop:
    def __init__(self, cfg: ControllerSettings, worker_id: str, bus: StreamBus, drivers: dict[str, RunDriver],
                 wake: asyncio.Event):
        self.drivers, self.wake = drivers, wake
        self.consumer = StreamConsumer(bus, RUN_CONTROL, GROUP_CONTROLLER, worker_id, expect=RunControl,
                                       claim_idle_ms=cfg.store_claim_idle_ms)

    async def run(self, stop: asyncio.Event) -> None:
        await self.consumer.run(self.apply, stop)

    async def apply(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            cmd: RunControl = d.message
            driver = self.drivers.get(cmd.run_id)
            if driver is None or cmd.sent_at <= driver.status_read_at or not cmd.applies_to(driver.status):
                continue  # not ours, or already known from the runs table
            log.info("%s: %s -> %s", cmd.action, driver.status, cmd.status, extra={"run_id": cmd.run_id})
            driver.status = cmd.status
            self.wake.set()
