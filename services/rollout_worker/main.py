"""rollout-worker: runs agents (agent <-> inference engine <-> env workers) for every run's tasks.

    REDIS_URL=... DATABASE_URL=... MAX_CONCURRENCY=64 python -m services.rollout_worker.main

Consumes `rollout.tasks` (group "rollout"), publishes EpisodeResults to `trajectories`, follows `weights`."""

from __future__ import annotations

import os
import sys


def main() -> None:
    # Prompts are tokenized one at a time from many coroutines: the tokenizers' thread pool only adds
    # contention on 2-core nodes. Set TOKENIZERS_PARALLELISM=true to override.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from services.rollout_worker.config import RolloutWorkerConfig
    from shared.logs import get_logger, setup_logging

    cfg = RolloutWorkerConfig()
    setup_logging(cfg.service_name, cfg.log_level, cfg.log_format)
    get_logger(__name__).info("rollout-worker config: %s", cfg.loggable())
    from shared.service import run_service

    sys.exit(run_service(serve(cfg)))


async def serve(cfg) -> int:
    from services.rollout_worker.worker import RolloutWorker
    from shared.bus import connect
    from shared.db.session import make_engine
    from shared.service import ServiceRuntime

    runtime = ServiceRuntime(cfg, cfg.service_name, shutdown_timeout_s=cfg.drain_timeout_s + 10)
    redis = connect(cfg.redis_url)
    db = make_engine(cfg.database_url, pool_size=2)
    worker = RolloutWorker(cfg, runtime.worker_id, redis, db)
    await worker.start()

    async def on_stop() -> None:
        await worker.close()
        await redis.aclose()
        db.dispose()

    worker.status = runtime.status  # reported by /healthz and the heartbeat
    return await runtime.run(worker.loops(runtime.stop), on_stop=on_stop)


if __name__ == "__main__":
    main()
