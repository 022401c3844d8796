"""`flywheel-jobs` (or `python -m services.jobs.main`): a Celery worker for background jobs, Redis as broker.

Next to Celery's own loop, a thread serves /healthz and /metrics on HEALTH_PORT and refreshes the Redis
heartbeat key (shared.service.ServiceRuntime without its signal handling: Celery owns the signals)."""

from __future__ import annotations

import asyncio
import threading

from services.jobs.config import JobsConfig
from shared.logs import get_logger, setup_logging
from shared.service import ServiceRuntime

log = get_logger(__name__)


class _ThreadRuntime(ServiceRuntime):
    def _install_signals(self) -> None:  # signal handlers only work in the main thread, which Celery owns
        pass


def start_health_thread(config: JobsConfig) -> tuple[threading.Thread, callable]:
    runtime = _ThreadRuntime(config, "jobs")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(runtime.run([])), daemon=True, name="health")
    thread.start()
    return thread, lambda: loop.call_soon_threadsafe(runtime.stop.set)


def main() -> None:
    config = JobsConfig()
    setup_logging(config.service_name, config.log_level, config.log_format)
    log.info("jobs config: %s", config.loggable())
    from services.jobs.celery_app import make_celery

    app = make_celery(config)
    thread, stop_health = start_health_thread(config)
    argv = ["worker", f"--pool={config.jobs_pool}", f"--concurrency={config.jobs_concurrency}",
            f"--hostname=jobs-{config.worker_id or '%h'}-%i", "--loglevel", config.log_level,
            "--without-gossip", "--without-mingle"]
    if config.jobs_beat:
        argv.append("--beat")
    try:
        app.worker_main(argv)
    finally:
        stop_health()
        thread.join(timeout=10)


if __name__ == "__main__":
    main()
