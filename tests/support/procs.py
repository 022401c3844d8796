"""The one way tests and benchmarks start a service (or helper) process without a whole stack
(`infra.local.stack.LocalStack` starts, supervises and stops many), and the waits that go with it:

    proc = start_service("services.env_worker.main", redis_url=url, worker_id="env-a")
    health = wait_heartbeat(url, "env-worker", "env-a", proc)   # dict incl. "port" of /healthz and /metrics
    wait_http(f"http://127.0.0.1:{port}/healthz", proc)         # or: wait until an HTTP service answers 200
    wait_until(lambda: done(), 30, "the run to end", procs=[proc])  # any condition; fails early if proc exits
    output = stop(proc)                                         # SIGTERM, SIGKILL after a timeout; its output

    with ServiceGroup(tmp_path, redis_url=url) as group:        # several, logs in one folder, stopped together
        group.start("controller", "services.controller.main", worker_id="ctl-0")

Keyword arguments become upper-case environment variables over the inherited environment (HEALTH_PORT=0,
LOG_FORMAT=text and PYTHONUNBUFFERED=1 unless given; None removes a variable). Output goes to a pipe that `stop`
returns, or to `log` (an open file or a path).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import httpx
import redis

from shared.contracts.streams import heartbeat_key

REPO = Path(__file__).resolve().parents[2]


def start_service(target: str, *, log: IO | Path | int | None = None, launcher: Iterable[str] = (),
                  args: Iterable[str] = (), python: str | Path = sys.executable, within: Iterable[str] = (),
                  **env: str | None) -> subprocess.Popen:
    """`python [launcher...] -m target [args...]` (a module) or `python [launcher...] target [args...]` (a .py
    script) from the repository root; output to `log`, else a text pipe `stop` reads (keep a long-lived, chatty
    process on a log file: nobody drains the pipe until `stop`). `python`: another environment's interpreter
    (the vLLM one: pass VIRTUAL_ENV=None too). `within`: a command the process runs under (`ShapedNetwork.
    exec_prefix(host)`: inside that host's network namespace). `env`: on top of ours; a None value removes the
    variable."""
    full_env = {**os.environ, "HEALTH_PORT": "0", "LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1",
                **{k.upper(): str(v) for k, v in env.items() if v is not None}}
    for key in (k.upper() for k, v in env.items() if v is None):
        full_env.pop(key, None)
    entry = [target] if target.endswith(".py") else ["-m", target]
    if isinstance(log, Path):
        log = open(log, "w")  # noqa: SIM115 - the child holds it open for its whole life
    return subprocess.Popen([*within, str(python), *launcher, *entry, *args], cwd=REPO, env=full_env,
                            stdin=subprocess.DEVNULL, stdout=log if log is not None else subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=log is None)


class ServiceGroup:
    """Service processes sharing one environment and one log folder (`<name>.log` each), stopped together."""

    def __init__(self, logs: Path, **env: str | None):
        self.logs, self.env, self.procs = Path(logs), env, {}
        self.logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, target: str, *, launcher: Iterable[str] = (), args: Iterable[str] = (),
              **env: str | None) -> subprocess.Popen:
        self.procs[name] = start_service(target, log=self.logs / f"{name}.log", launcher=launcher, args=args,
                                         **{**self.env, **env})
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to all at once, then `stop` each (SIGKILL after `timeout_s`)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            stop(p, timeout_s)

    def __enter__(self) -> ServiceGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _check_procs(procs: Iterable[subprocess.Popen], what: str) -> None:
    for p in procs:
        if p.poll() is not None:
            raise RuntimeError(f"{p.args} exited with {p.returncode} while waiting for {what}")


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str, *, procs: Iterable[subprocess.Popen] = (),
               interval_s: float = 0.1) -> Any:
    """`pred()`'s first truthy value; TimeoutError naming `what` when the time runs out, RuntimeError as soon as
    one of `procs` exits (a dead service would otherwise cost the whole timeout)."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        _check_procs(procs, what)
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


async def wait_until_async(pred: Callable[[], Any], timeout_s: float, what: str, *,
                           procs: Iterable[subprocess.Popen] = (), interval_s: float = 0.05) -> Any:
    """`wait_until` for a test's event loop: sleeps with asyncio, so the loop's own tasks go on meanwhile;
    `pred` may be a coroutine function."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        _check_procs(procs, what)
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 30.0) -> None:
    """Return once `url` answers 200; raise if `proc` exits first or the time runs out."""
    def up() -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout_s, f"{url} to answer 200", procs=[proc] if proc else [])


def wait_heartbeat(redis_url: str, service: str, worker_id: str, proc: subprocess.Popen | None = None,
                   timeout_s: float = 60.0) -> dict:
    """The heartbeat a service writes to Redis (`heartbeat:<service>:<worker_id>`) once it holds its port."""
    client = redis.Redis.from_url(redis_url)

    def beat() -> dict | None:
        raw = client.get(heartbeat_key(service, worker_id))
        health = json.loads(raw) if raw else {}
        return health if health.get("port") else None

    try:
        return wait_until(beat, timeout_s, f"{service} {worker_id}'s heartbeat", procs=[proc] if proc else [])
    except RuntimeError as e:  # it exited: its output (when piped) says why
        output = proc.stdout.read() if proc is not None and proc.stdout else ""
        raise RuntimeError(f"{e}:\n{output[-5000:]}") from None
    finally:
        client.close()


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
