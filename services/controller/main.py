"""Run controller.

    REDIS_URL=... DATABASE_URL=... python -m services.controller.main

Applies run commands and drives every active run it can lease (loops.py); several controllers
may run side by side."""

from __future__ import annotations

import sys

from services.controller.settings import ControllerSettings
from shared.platform.service import Loops, ServiceRuntime, run_service


def main() -> int:
    return run_service(ControllerSettings(), build)


async def build(cfg: ControllerSettings, runtime: ServiceRuntime) -> Loops:
    from services.controller.loops import Controller
    from shared.platform.bus import StreamBus, connect
    from shared.platform.db.session import make_engine

    engine = make_engine(cfg.database_url, pool_size=4)
    runtime.on_stop(engine.dispose)
    bus = StreamBus(connect(cfg.redis_url))
    runtime.on_stop(bus.close)
    controller = Controller(cfg, runtime.worker_id, engine, bus)
    runtime.on_stop(controller.close)
    runtime.status = controller.status  # /healthz and the heartbeat show the runs driven
    return controller.loops(runtime.stop)


if __name__ == "__main__":
    sys.exit(main())
