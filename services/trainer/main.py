"""Trainer: `python -m services.trainer.main` (or `flywheel-trainer`).

Trains every running `kind=train` run it can lease, on what the store accepted (`results.accepted`), with verl's FSDP2 engine
(CPU by default; DEVICE=cuda on GPUs), and publishes a checkpoint to the weight server after each step.
Under torchrun rank 0 runs the service and the other ranks follow its engine calls (ranks.py).
"""

from __future__ import annotations

import os
import sys

from services.trainer.settings import TrainerSettings
from shared.platform.service import Loops, ServiceRuntime, run_service, setup_service


def main() -> int:
    settings = TrainerSettings()
    if _distributed() and int(os.environ["RANK"]) > 0:  # a follower serves nothing: no health port, no heartbeat
        setup_service(settings)
        from services.trainer.engine import setup_distributed
        from services.trainer.ranks import follow

        setup_distributed(settings.device)
        follow()
        return 0
    return run_service(settings, build, shutdown_timeout_s=120.0)


async def build(settings: TrainerSettings, runtime: ServiceRuntime) -> Loops:
    if _distributed():  # rank 0 joins the ranks' process group before building its engines
        from services.trainer.engine import setup_distributed

        setup_distributed(settings.device)
    from services.trainer.loop import Trainer
    from shared.platform.db.session import make_engine

    db_engine = make_engine(settings.database_url)
    runtime.on_stop(db_engine.dispose)
    trainer = Trainer(settings, runtime.redis, db_engine, runtime.worker_id)
    runtime.status = trainer.status  # /healthz shows the runs and their versions
    return [trainer.serve(runtime.stop)]


def _distributed() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1  # started by torchrun with more than one rank


if __name__ == "__main__":
    sys.exit(main())
