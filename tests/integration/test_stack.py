"""The local stack (`make up`): every service starts as a real process and reports healthy, a killed worker
comes back on restart, stop() leaves no process behind, and the embedded servers keep their data.

    pytest -q tests/integration/test_stack.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import redis
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from infra.local_stack import SERVICES, LocalStack, ServiceSpec
from shared.db.models import Dataset
from shared.streams import heartbeat_key

# A minimal service on the real runtime: /healthz, /metrics and a heartbeat, nothing else. It exercises the
# stack's mechanics (ports, restart, signals) independently of how far the real services have come.
PROBE = ServiceSpec((
    "-c",
    "import asyncio\n"
    "from shared.service import ServiceRuntime\n"
    "from shared.settings import ServiceSettings\n"
    "async def main():\n"
    "    rt = ServiceRuntime(ServiceSettings(), 'probe')\n"
    "    raise SystemExit(await rt.run([rt.stop.wait()]))\n"
    "asyncio.run(main())\n",
))


def process_tree(stack: LocalStack) -> list[psutil.Process]:
    procs = []
    for inst in stack.instances:
        if inst.alive:
            root = psutil.Process(inst.proc.pid)
            procs += [root, *root.children(recursive=True)]
    return procs


def assert_all_gone(procs: list[psutil.Process]) -> None:
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def wait_heartbeats(client: redis.Redis, names: list[str], timeout_s: float = 15.0) -> set[str]:
    """Service names with a live heartbeat key, once all are there or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {n for n in names if client.keys(heartbeat_key(n, "*"))}
        if seen == set(names) or time.monotonic() > deadline:
            return seen
        time.sleep(0.25)


def test_every_service_starts_healthy_and_stops_clean(redis_url, database_url, tmp_path):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    stack = LocalStack(tmp_path, env={"REDIS_URL": redis_url, "DATABASE_URL": database_url})
    try:
        stack.start()  # every service, one process each
        assert sorted(i.name for i in stack.instances) == sorted(SERVICES)
        stack.wait_healthy(120)
        assert wait_heartbeats(client, list(SERVICES)) == set(SERVICES)
        procs = process_tree(stack)
    finally:
        stack.stop()
    assert_all_gone(procs)
    assert all(not i.alive for i in stack.instances)
    for inst in stack.instances:
        assert inst.log_path.exists(), f"no log file for {inst.label}"


def test_kill_restart_and_idempotent_stop(redis_url, database_url, tmp_path):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "HEARTBEAT_INTERVAL_S": "0.5"}
    stack = LocalStack(tmp_path, env=env, specs={"probe": PROBE})
    try:
        stack.start(counts={"probe": 2})
        stack.wait_healthy(30)
        ports = [i.port for i in stack.instances]
        assert len(set(ports)) == 2
        assert client.exists(heartbeat_key("probe", "probe-0"), heartbeat_key("probe", "probe-1")) == 2

        stack.kill("probe", 1, signal.SIGKILL)
        stack.instance("probe", 1).proc.wait(10)
        assert stack.instance("probe", 0).alive and not stack.instance("probe", 1).alive

        stack.restart("probe", 1)
        stack.start(["probe"])  # scale out on a running stack
        stack.wait_healthy(30)
        assert [i.label for i in stack.instances] == ["probe-0", "probe-1", "probe-2"]
        assert [i.port for i in stack.instances][:2] == ports  # same address after restart
        procs = process_tree(stack)
    finally:
        stack.stop()
        stack.stop()
    assert_all_gone(procs)
    assert not client.keys(heartbeat_key("probe", "*")), "a graceful stop removes the heartbeat"


def test_unknown_service_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown service"):
        LocalStack(tmp_path).start(["no-such-service"])


def test_embedded_servers_keep_data_across_restarts(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    # The probe, and the Celery worker: kombu reaches Redis over the unix socket only through its own URL form.
    specs = {"probe": PROBE, "jobs": SERVICES["jobs"]}

    with LocalStack(tmp_path, specs=specs) as stack:
        stack.start()
        stack.wait_healthy(60)
        assert stack.redis_url.startswith("unix://") and "host=" in stack.database_url
        client = redis.Redis.from_url(stack.redis_url)
        assert wait_heartbeats(client, ["probe", "jobs"]) == {"probe", "jobs"}
        client.xadd("survivor", {"k": "v"})
        engine = create_engine(stack.database_url)
        with Session(engine) as s, s.begin():
            s.add(Dataset(name="survivor", split="train"))
        engine.dispose()
        servers = [psutil.Process(stack.redis.server.pid), psutil.Process(stack.postgres.server.get_pid())]
        procs = process_tree(stack) + servers
    assert_all_gone(procs)

    with LocalStack(tmp_path, specs={"probe": PROBE}) as stack:
        stack.start()
        stack.wait_healthy(30)
        assert redis.Redis.from_url(stack.redis_url).xlen("survivor") == 1  # AOF replayed
        engine = create_engine(stack.database_url)
        with Session(engine) as s:
            assert s.scalar(select(Dataset.name).where(Dataset.name == "survivor")) == "survivor"
        engine.dispose()
    assert (tmp_path / "logs" / "probe-0.log").exists()


def test_console_entry_stops_everything_on_ctrl_c(redis_url, database_url, tmp_path):
    env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": database_url, "DATA_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "infra.local_stack", "--services", "controller"]
    stack = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in stack.stdout:
            lines.append(line)
            if "all services healthy" in line:
                break
        children = psutil.Process(stack.pid).children(recursive=True)
        assert any("services.controller.main" in " ".join(p.cmdline()) for p in children), "".join(lines)
        stack.send_signal(signal.SIGINT)
        rest, _ = stack.communicate(timeout=60)
    finally:
        stack.kill()
    assert stack.returncode == 0, "".join(lines) + rest
    assert "controller-0 " in "".join(lines)  # service output is echoed with its name
    assert_all_gone(children)
    assert (tmp_path / "logs" / "controller-0.log").read_text()
