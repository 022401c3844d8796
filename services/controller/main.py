"""Run controller.

    REDIS_URL=... DATABASE_URL=... python -m services.controller.main

Drives every active run it can lease (see controller.py); several controllers may run side by side."""

from __future__ import annotations

import sys


def main() -> None:
    from services.controller.config import ControllerConfig
    from shared.logs import get_logger, setup_logging

    cfg = ControllerConfig()
    setup_logging(cfg.service_name, cfg.log_level, cfg.log_format)
    get_logger(__name__).info("controller config: %s", cfg.loggable())
    from shared.service import run_service

    sys.exit(run_service(serve(cfg)))


async def serve(cfg) -> int:
    from services.controller.controller import Controller
    from shared.bus import StreamBus, connect
    from shared.db.session import make_engine
    from shared.service import ServiceRuntime

    runtime = ServiceRuntime(cfg, cfg.service_name)
    engine = make_engine(cfg.database_url, pool_size=4)
    bus = StreamBus(connect(cfg.redis_url))
    controller = Controller(cfg, runtime.worker_id, engine, bus)

    async def on_stop() -> None:
        await controller.close()
        await bus.close()
        engine.dispose()

    controller.status = runtime.status  # reported by /healthz and the heartbeat
    return await runtime.run(controller.loops(runtime.stop), on_stop=on_stop)


if __name__ == "__main__":
    main()
