"""The trim loop, every trim_interval_s: drop the acknowledged entries of the streams the controller reads or
writes (an entry is kept until every group of its stream acknowledged it: shared/platform/bus/publish.py)."""

from __future__ import annotations

import asyncio

from shared.contracts.streams import (
    ACCEPTED_RESULTS,
    ROLLOUT_TASKS,
    RUN_COMMANDS,
    RUN_CONTROL,
    TRAINER_PROGRESS,
    TRAJECTORIES,
)
from shared.platform.bus import RedisError, StreamBus
from shared.platform.logs import get_logger
from shared.platform.service import sleep_or_stop

log = get_logger(__name__)
STREAMS = (ROLLOUT_TASKS, TRAJECTORIES, ACCEPTED_RESULTS, TRAINER_PROGRESS, RUN_COMMANDS, RUN_CONTROL)


async def trim_loop(bus: StreamBus, interval_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await sleep_or_stop(stop, interval_s)
        for stream in STREAMS:
            try:
                await bus.trim_acknowledged(stream)
            except RedisError as e:
                log.warning("trim of %s failed: %r", stream, e)
