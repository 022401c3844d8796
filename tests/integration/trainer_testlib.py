"""Helpers for the trainer and weight-server integration tests: start the weight server as a process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WeightServer:
    def __init__(self, redis_url: str, database_url: str, weights_dir: Path, keep_last: int = 2, **env: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": database_url,
                    "WEIGHTS_DIR": str(weights_dir), "WEIGHT_SERVER_PORT": str(self.port),
                    "KEEP_LAST": str(keep_last), "LOG_FORMAT": "text", **env}
        self.proc: subprocess.Popen | None = None

    def start(self) -> WeightServer:
        self.proc = subprocess.Popen([sys.executable, "-m", "services.weight_server.main"], cwd=REPO, env=self.env)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, "weight server exited during start-up"
            time.sleep(0.2)
        raise TimeoutError("weight server did not become healthy")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)
