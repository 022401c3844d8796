"""env-worker: hosts environment sessions for rollout workers.

    REDIS_URL=redis://127.0.0.1:6379/0 python -m services.env_worker.main

Reads `env.requests` (group "env") and its own inbox `env.inbox.<WORKER_ID>`; see worker.py."""

from __future__ import annotations

import sys


def main() -> None:
    from services.env_worker.config import EnvWorkerConfig
    from shared.logs import get_logger, setup_logging

    cfg = EnvWorkerConfig()
    setup_logging(cfg.service_name, cfg.log_level, cfg.log_format)
    get_logger(__name__).info("env-worker config: %s", cfg.loggable())
    from shared.service import run_service

    sys.exit(run_service(serve(cfg)))


async def serve(cfg) -> int:
    from services.env_worker.worker import EnvWorker
    from shared.bus import connect
    from shared.service import ServiceRuntime

    runtime = ServiceRuntime(cfg, cfg.service_name)
    redis = connect(cfg.redis_url)
    worker = EnvWorker(cfg, runtime.worker_id, redis)

    async def on_stop() -> None:
        await worker.close()
        await redis.aclose()

    worker.status = runtime.status  # reported by /healthz and the heartbeat
    return await runtime.run(worker.loops(runtime.stop), on_stop=on_stop)


if __name__ == "__main__":
    main()
