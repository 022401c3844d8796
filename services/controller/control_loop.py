"""The control loop: every controller reads `run.control` as a broadcast (its own cursor, no group) -> a
user's pause, resume or stop applied at once by the controller driving the run, then the dispatch loop woken.
The next poll of the runs table remains the fallback.

A message is applied only when its `status_version` is above the driver's and the driver's status is one it
starts from: one read late never undoes a newer status. A sequence, not clocks: controllers whose clocks
disagree still order pause and stop right.

More: docs/architecture.md#run-commands-and-run-control
"""

from __future__ import annotations

import asyncio

from services.controller.run_driver import RunDriver
from shared.contracts.messages import RunControl
from shared.contracts.streams import RUN_CONTROL
from shared.platform.bus import BroadcastReader, StreamBus
from shared.platform.logs import get_logger

log = get_logger(__name__)


class ControlLoop:
    def __init__(self, bus: StreamBus, drivers: dict[str, RunDriver], wake: asyncio.Event):
        self.drivers, self.wake = drivers, wake
        self.reader = BroadcastReader(bus.redis, RUN_CONTROL, RunControl)

    async def run(self, stop: asyncio.Event) -> None:
        await self.reader.start()
        while not stop.is_set():
            self.apply(await self.reader.read())

    def apply(self, messages: list[RunControl]) -> None:
        for cmd in messages:
            driver = self.drivers.get(cmd.run_id)
            if driver is None or cmd.status_version <= driver.status_version or not cmd.applies_to(driver.status):
                continue  # not ours, or already known from the runs table
            log.info("%s: %s -> %s", cmd.action, driver.status, cmd.status, extra={"run_id": cmd.run_id})
            driver.status, driver.status_version = cmd.status, cmd.status_version
            self.wake.set()
