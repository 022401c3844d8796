"""`flywheel-jobs` (or `python -m services.jobs.main`): the jobs service, the one writer of `jobs`. A Celery worker
runs the jobs (Redis as broker); beside it the intake stores the jobs callers ask for on `jobs.requests` and
sends their tasks (intake.py).

Celery's worker owns the main thread and its signals; beside it the service runtime runs the intake, serves
/healthz and /metrics on HEALTH_PORT and refreshes the Redis heartbeat key (shared.platform.service.run_service's
`foreground`)."""

from __future__ import annotations

import sys

from services.jobs.settings import JobsSettings
from shared.platform.service import Loops, ServiceRuntime, run_service


def main() -> int:
    return run_service(JobsSettings(), build, foreground=run_celery)


async def build(config: JobsSettings, runtime: ServiceRuntime) -> Loops:
    from services.jobs.celery_app import celery_client
    from services.jobs.intake import JobIntake
    from shared.platform.bus import StreamBus, connect
    from shared.platform.db.session import make_engine

    engine = make_engine(config.database_url, pool_size=2)
    runtime.on_stop(engine.dispose)
    bus = StreamBus(connect(config.redis_url))
    runtime.on_stop(bus.close)
    intake = JobIntake(runtime.worker_id, engine, bus, celery_client(config.redis_url))
    return [intake.run(runtime.stop)]


def run_celery(config: JobsSettings) -> None:
    from services.jobs.celery_app import make_celery

    argv = ["worker", f"--pool={config.jobs_pool}", f"--concurrency={config.jobs_concurrency}",
            f"--hostname=jobs-{config.worker_id or '%h'}-%i", "--loglevel", config.log_level,
            "--without-gossip", "--without-mingle"]
    if config.jobs_beat:
        argv.append("--beat")
    make_celery(config).worker_main(argv)


if __name__ == "__main__":
    sys.exit(main())
