"""Trainer: `python -m services.trainer.main` (or `flywheel-trainer`).

Trains every running `kind=train` run it can lease, from the `trajectories` stream, with verl's FSDP2 engine
(CPU by default; DEVICE=cuda on GPUs), and publishes a checkpoint to the weight server after each step.
"""

from __future__ import annotations

import asyncio
import sys


def main() -> int:
    from services.trainer.config import TrainerSettings
    from shared.logs import get_logger, setup_logging

    settings = TrainerSettings()
    setup_logging(settings.service_name, settings.log_level, settings.log_format)
    get_logger(__name__).info("config: %s", settings.loggable())

    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: rank 0 serves, the other ranks follow it
        from services.trainer.engine import setup_distributed

        setup_distributed(settings.device)
        if int(os.environ["RANK"]) > 0:
            from services.trainer.ranks import follow

            follow()
            return 0

    from services.trainer.loop import Trainer
    from shared.db.session import make_engine
    from shared.service import ServiceRuntime

    runtime = ServiceRuntime(settings, settings.service_name, shutdown_timeout_s=120.0)
    db_engine = make_engine(settings.database_url)
    trainer = Trainer(settings, runtime.redis, db_engine, runtime.worker_id)
    runtime.status = trainer.status  # /healthz shows the runs and their versions

    async def stop() -> None:
        db_engine.dispose()

    return asyncio.run(runtime.run([trainer.serve(runtime.stop)], on_stop=stop))


if __name__ == "__main__":
    sys.exit(main())
