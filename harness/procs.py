"""One service (or helper) process at a time, for tests and benchmarks that do not need a whole stack
(`harness.stack.LocalStack` starts, supervises and stops many):

    proc = start_service("services.env_worker.main", redis_url=url, worker_id="env-a")
    health = wait_heartbeat(url, "env-worker", "env-a", proc)   # dict incl. "port" of /healthz and /metrics
    wait_http(f"http://127.0.0.1:{port}/healthz", proc)         # or: wait until an HTTP service answers 200
    output = stop(proc)                                         # SIGTERM, SIGKILL after a timeout; its output

Keyword arguments become upper-case environment variables over the inherited environment (HEALTH_PORT=0,
LOG_FORMAT=text and PYTHONUNBUFFERED=1 unless given). Output goes to a pipe that `stop` returns, or to `log`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx
import redis

REPO = Path(__file__).resolve().parents[1]


def start_service(module: str, *, log: IO | None = None, **env: str) -> subprocess.Popen:
    """`python -m module` from the repository root; output to `log`, else a text pipe `stop` reads."""
    full_env = {**os.environ, "HEALTH_PORT": "0", "LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1",
                **{k.upper(): str(v) for k, v in env.items()}}
    return subprocess.Popen([sys.executable, "-m", module], cwd=REPO, env=full_env, stdin=subprocess.DEVNULL,
                            stdout=log if log is not None else subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=log is None)


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 30.0) -> None:
    """Return once `url` answers 200; raise if `proc` exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not up after {timeout_s}s")


def wait_heartbeat(redis_url: str, service: str, worker_id: str, proc: subprocess.Popen | None = None,
                   timeout_s: float = 60.0) -> dict:
    """The heartbeat a service writes to Redis (`heartbeat:<service>:<worker_id>`) once it holds its port."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = client.get(f"heartbeat:{service}:{worker_id}")
        if raw:
            health = json.loads(raw)
            if health.get("port"):
                return health
        if proc is not None and proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"{service} exited with {proc.returncode}:\n{output}")
        time.sleep(0.1)
    raise TimeoutError(f"{service} {worker_id} sent no heartbeat within {timeout_s}s")


def stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> str:
    """SIGTERM, wait, SIGKILL if it does not stop in time; return its output when it went to a pipe (the exit
    code is `proc.returncode`). Safe to call twice."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is None or proc.stdout.closed:
        return ""
    output = proc.stdout.read()
    proc.stdout.close()
    return output
