"""The command loop: group "controller" on `run.commands` -> a run created, paused, resumed or stopped
(queries.apply_command: one transaction, idempotent by command id), then:

- a pause, resume or stop applied is published on `run.control`, for the controller driving the run and the
  trainer training it (control_loop.py applies it to the driver);
- the `RunCommandReply` goes on the command's reply stream, which expires after a minute (`StreamBus.answer`);
- the dispatch loop is woken (a new run is leased at its next poll; a stopped one takes back its tasks).

A command read after its `expires_at` is answered `expired` and not applied: its sender has already told its
caller that nothing changed. The controller's clock judges it against the sender's, so a skew between hosts
shortens or lengthens the wait by that much.
"""

from __future__ import annotations

import asyncio
import time

from services.controller import queries
from services.controller.settings import ControllerSettings
from shared.contracts.messages import RunCommand, RunControl
from shared.contracts.streams import GROUP_CONTROLLER, RUN_COMMANDS, RUN_CONTROL, command_reply
from shared.platform.bus import Delivery, StreamBus, StreamConsumer
from shared.platform.logs import get_logger

log = get_logger(__name__)


class CommandLoop:
    def __init__(self, cfg: ControllerSettings, worker_id: str, db, bus: StreamBus, wake: asyncio.Event):
        self.db, self.bus, self.wake = db, bus, wake
        self.consumer = StreamConsumer(bus, RUN_COMMANDS, GROUP_CONTROLLER, worker_id, expect=RunCommand,
                                       claim_idle_ms=cfg.store_claim_idle_ms)

    async def run(self, stop: asyncio.Event) -> None:
        await self.consumer.run(self.apply, stop)

    async def apply(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            cmd: RunCommand = d.message
            reply = await asyncio.to_thread(queries.apply_command, self.db, cmd, time.time() > cmd.expires_at)
            log.info("%s: %s (%s)", cmd.action, reply.outcome, reply.status, extra={"run_id": cmd.run_id})
            if reply.outcome == "applied" and cmd.action != "create":
                await self.bus.publish(RUN_CONTROL, RunControl(run_id=cmd.run_id, action=cmd.action,
                                                               sent_at=time.time()))
            await self.bus.answer(command_reply(cmd.command_id), reply)
            self.wake.set()
