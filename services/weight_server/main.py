"""Weight server: `python -m services.weight_server.main` (or `flywheel-weight-server`).

Stores versioned HF checkpoints under WEIGHTS_DIR, serves them over HTTP on WEIGHT_SERVER_PORT and announces
each new version on the `weights` stream once it is durable.
"""

from __future__ import annotations

import sys


def main() -> int:
    from services.weight_server.config import WeightServerSettings
    from shared.logs import get_logger, setup_logging

    settings = WeightServerSettings()
    setup_logging(settings.service_name, settings.log_level, settings.log_format)
    get_logger(__name__).info("config: %s", settings.loggable())

    import redis

    from services.weight_server.app import build_router
    from services.weight_server.store import CheckpointStore
    from shared.db.session import make_engine
    from shared.service import ServiceRuntime, run_service

    engine = make_engine(settings.database_url)
    store = CheckpointStore(settings.weights_dir, engine, redis.Redis.from_url(settings.redis_url),
                            settings.public_url, settings.keep_last, settings.announce_path,
                            settings.verify_staging)
    store.reconcile()
    runtime = ServiceRuntime(settings, settings.service_name)
    runtime.app.include_router(build_router(store))
    runtime.status["weights_dir"] = str(settings.weights_dir)
    return run_service(runtime.run([runtime.stop.wait()], on_stop=_dispose(engine)))


def _dispose(engine):
    async def stop() -> None:
        engine.dispose()
    return stop


if __name__ == "__main__":
    sys.exit(main())
