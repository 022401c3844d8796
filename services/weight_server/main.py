"""Weight server: `python -m services.weight_server.main` (or `flywheel-weight-server`).

Stores versioned HF checkpoints under WEIGHTS_DIR, serves them over HTTP on WEIGHT_SERVER_PORT and announces
each new version on the `weights` stream once it is durable.
"""

from __future__ import annotations

import sys

from services.weight_server.settings import WeightServerSettings
from shared.platform.service import Loops, ServiceRuntime, run_service


def main() -> int:
    return run_service(WeightServerSettings(), build)


async def build(settings: WeightServerSettings, runtime: ServiceRuntime) -> Loops:
    from services.weight_server.app import build_router
    from services.weight_server.exports import ExportStore, build_exports_router
    from services.weight_server.store import CheckpointStore
    from shared.platform.bus import connect_sync
    from shared.platform.db.session import make_engine

    engine = make_engine(settings.database_url)
    runtime.on_stop(engine.dispose)
    store = CheckpointStore(settings.weights_dir, engine, connect_sync(settings.redis_url),
                            settings.public_url, settings.keep_last, settings.announce_path,
                            settings.verify_staging, settings.snapshot_every)
    store.reconcile()
    runtime.on_stop(store.close)
    runtime.app.include_router(build_router(store))  # uploads and downloads beside /healthz, on one port
    runtime.app.include_router(build_exports_router(ExportStore(settings.weights_dir)))
    runtime.status["weights_dir"] = str(settings.weights_dir)
    return []  # HTTP is all it serves


if __name__ == "__main__":
    sys.exit(main())
