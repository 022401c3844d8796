"""rollout-worker: runs agents (agent <-> inference engine <-> env workers) for every run's tasks.

    REDIS_URL=... DATABASE_URL=... MAX_CONCURRENCY=64 python -m services.rollout_worker.main

Consumes `rollout.tasks` (group "rollout"), publishes EpisodeResults to `trajectories`, follows `weights`."""

from __future__ import annotations

import os
import sys

from services.rollout_worker.settings import RolloutWorkerSettings
from shared.platform.service import Loops, ServiceRuntime, run_service


def main() -> int:
    # Prompts are tokenized one at a time from many coroutines: the tokenizers' thread pool only adds
    # contention on 2-core nodes. Set TOKENIZERS_PARALLELISM=true to override.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = RolloutWorkerSettings()
    return run_service(cfg, build, shutdown_timeout_s=cfg.drain_timeout_s + 10)


async def build(cfg: RolloutWorkerSettings, runtime: ServiceRuntime) -> Loops:
    from services.rollout_worker.worker import RolloutWorker, available_engines
    from shared.platform.bus import connect
    from shared.platform.db.session import make_engine

    redis = connect(cfg.redis_url)
    runtime.on_stop(redis.aclose)
    db = make_engine(cfg.database_url, pool_size=2)
    runtime.on_stop(db.dispose)
    relay = None
    if cfg.relay_url:  # checkpoints through the relay chain; serve them to the workers after this one
        from services.rollout_worker.weight_relay import Relay, relay_router

        relay = Relay(cfg.relay_url)
        runtime.app.include_router(relay_router(relay))
    worker = RolloutWorker(cfg, runtime.worker_id, redis, db, relay)
    await worker.start()
    runtime.on_stop(worker.close)
    worker.status = runtime.status  # reported by /healthz and the heartbeat
    runtime.status["engines"] = available_engines()
    runtime.status["max_concurrency"] = cfg.max_concurrency  # the controller shares these slots between runs
    return worker.loops(runtime.stop)


if __name__ == "__main__":
    sys.exit(main())
