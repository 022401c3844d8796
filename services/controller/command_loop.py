"""The command loop: group "controller" on `run.commands` -> a run created, paused, resumed or stopped
(run_commands.apply_command: one transaction, idempotent by command id), then the change published on
`run.control`, the `RunCommandReply` put on the command's reply stream, and the dispatch loop woken.

A command read more than `expires_at - sent_at` seconds (the sender's wait) after it entered the stream is
answered `expired` and not applied. The age is read on Redis's clock (`Delivery.age_s`), so hosts whose clocks
disagree wait exactly what was asked.

More: docs/architecture.md#run-commands-and-run-control
"""

from __future__ import annotations

import asyncio
import time

from services.controller import run_commands
from services.controller.settings import ControllerSettings
from shared.contracts.messages import RunCommand, RunControl
from shared.contracts.messages.control import TRANSITIONS
from shared.contracts.streams import GROUP_CONTROLLER, RUN_COMMANDS, RUN_CONTROL, command_reply
from shared.platform.bus import Delivery, StreamBus, StreamConsumer, redis_time
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
        now = await redis_time(self.bus.redis)
        for d in deliveries:
            cmd: RunCommand = d.message
            expired = d.age_s(now) > cmd.expires_at - cmd.sent_at
            reply = await asyncio.to_thread(run_commands.apply_command, self.db, cmd, expired)
            log.info("%s: %s (%s)", cmd.action, reply.outcome, reply.status, extra={"run_id": cmd.run_id})
            # applied now (not a redelivery), and an action its trainer or driver applies
            if reply.status_version is not None and cmd.action in TRANSITIONS:
                await self.bus.publish(RUN_CONTROL, RunControl(run_id=cmd.run_id, action=cmd.action,
                                                               sent_at=time.time(),
                                                               status_version=reply.status_version))
            await self.bus.answer(command_reply(cmd.command_id), reply)
            self.wake.set()
