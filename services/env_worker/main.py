"""env-worker: hosts environment sessions for rollout workers.

    REDIS_URL=redis://127.0.0.1:6379/0 python -m services.env_worker.main

Reads `env.requests` (group "env") and its own inbox `env.inbox.<WORKER_ID>`; see worker.py."""

from __future__ import annotations

import sys

from services.env_worker.settings import EnvWorkerSettings
from shared.platform.logs import get_logger
from shared.platform.service import Loops, ServiceRuntime, run_service

log = get_logger(__name__)


def main() -> int:
    return run_service(EnvWorkerSettings(), build, dependencies=("redis",))  # no Postgres: ready with Redis alone


def check_sandbox(cfg: EnvWorkerSettings) -> None:
    """Fail at start, with the reason, when a sandbox mode this worker must give cannot run here (no fall back)."""
    from services.env_worker.sandbox import SandboxUnavailable, check_mode

    for mode in filter(None, (m.strip() for m in cfg.sandbox_modes.split(","))):
        try:
            check_mode(mode)
        except (SandboxUnavailable, ValueError) as e:
            raise SystemExit(f"env-worker: SANDBOX_MODES={cfg.sandbox_modes!r}: {e}") from None
        if mode == "namespaces":  # what this host let the sandbox have (a container: no /proc, no sysctl)
            from services.env_worker.sandbox.ns import layout

            lay = layout()
            log.info("sandbox mode namespaces: fresh /proc %s; nested user namespaces refused by %s", lay.proc,
                     "bwrap --disable-userns and seccomp" if lay.userns_sysctl else "seccomp (/proc/sys read-only)")


async def build(cfg: EnvWorkerSettings, runtime: ServiceRuntime) -> Loops:
    from services.env_worker.worker import EnvWorker
    from shared.platform.bus import connect

    check_sandbox(cfg)
    redis = connect(cfg.redis_url)
    runtime.on_stop(redis.aclose)
    worker = EnvWorker(cfg, runtime.worker_id, redis)
    runtime.on_stop(worker.close)
    worker.status = runtime.status  # reported by /healthz and the heartbeat
    return worker.loops(runtime.stop)


if __name__ == "__main__":
    sys.exit(main())
