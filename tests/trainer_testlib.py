"""Helpers for the trainer and weight-server integration tests: start the weight server as a process."""

from __future__ import annotations

import subprocess
from pathlib import Path

from infra.local.ports import free_port
from tests.support.procs import start_service, stop, wait_http

REPO = Path(__file__).resolve().parents[1]


class WeightServer:
    def __init__(self, redis_url: str, database_url: str, weights_dir: Path, keep_last: int = 2, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(weights_dir).parent / f"{Path(weights_dir).name}-server.log"
        self.env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "WEIGHTS_DIR": str(weights_dir),
                    "WEIGHT_SERVER_PORT": str(self.port), "KEEP_LAST": str(keep_last), **env}
        self.proc: subprocess.Popen | None = None

    def start(self) -> WeightServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = start_service("services.weight_server.main", log=self.log, **self.env)
        wait_http(f"{self.url}/healthz", self.proc)
        return self

    def stop(self) -> None:
        if self.proc:
            stop(self.proc, 15)
