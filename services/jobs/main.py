"""`flywheel-jobs` (or `python -m services.jobs.main`): a Celery worker for background jobs, Redis as broker.

Celery's worker owns the main thread and its signals; beside it the service runtime serves /healthz and
/metrics on HEALTH_PORT and refreshes the Redis heartbeat key (shared.service.run_service's `foreground`)."""

from __future__ import annotations

import sys

from services.jobs.config import JobsConfig
from shared.service import run_service


def main() -> int:
    return run_service(JobsConfig(), foreground=run_celery)


def run_celery(config: JobsConfig) -> None:
    from services.jobs.celery_app import make_celery

    argv = ["worker", f"--pool={config.jobs_pool}", f"--concurrency={config.jobs_concurrency}",
            f"--hostname=jobs-{config.worker_id or '%h'}-%i", "--loglevel", config.log_level,
            "--without-gossip", "--without-mingle"]
    if config.jobs_beat:
        argv.append("--beat")
    make_celery(config).worker_main(argv)


if __name__ == "__main__":
    sys.exit(main())
