"""The local stack (`make up`): every service starts as a real process and reports healthy, a killed worker
comes back on restart, stop() leaves no process behind, and the embedded servers keep their data. Supervised:
a killed service is restarted with backoff, a killed embedded Redis is restarted at the same address while
/readyz and the run view report the outage, and repeated SIGTERMs leave no orphan.

    pytest -q tests/e2e/test_stack.py
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from sqlalchemy import create_engine, insert, select
from sqlalchemy.orm import Session

from infra.local.ports import free_port
from infra.local.servers import RedisServer
from infra.local.stack import REPO, SERVICES, Backoff, LocalStack, ServiceSpec
from shared.contracts.db.models import Dataset, Run
from shared.contracts.streams import heartbeat_key
from tests.support.procs import wait_until

pytestmark = pytest.mark.slow  # minutes of processes

# A minimal service on the real runtime: /healthz, /metrics and a heartbeat, nothing else. It exercises the
# stack's mechanics (ports, restart, signals) independently of how far the real services have come.
PROBE = ServiceSpec((
    "-c",
    "import asyncio\n"
    "from shared.platform.service import ServiceRuntime\n"
    "from shared.platform.settings import ServiceSettings\n"
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
        # /healthz can answer a moment before the first heartbeat is written: both start together.
        keys = [heartbeat_key("probe", "probe-0"), heartbeat_key("probe", "probe-1")]
        wait_until(lambda: client.exists(*keys) == 2, 15, "both probes' heartbeats")

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
        servers = [psutil.Process(stack.redis.pid), psutil.Process(stack.postgres.pid)]
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


def start_console_stack(env: dict[str, str], services: str) -> tuple[subprocess.Popen, list[str]]:
    """`python -m infra.local.stack --services ...` (what `make up` runs), its output read until it reports every
    service healthy or exits; the caller stops it."""
    stack = subprocess.Popen([sys.executable, "-m", "infra.local.stack", "--services", services], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in stack.stdout:
        lines.append(line)
        if "all services healthy" in line:
            break
    return stack, lines


def test_console_entry_stops_everything_on_ctrl_c(redis_url, database_url, tmp_path):
    env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": database_url, "DATA_DIR": str(tmp_path)}
    stack, lines = start_console_stack(env, "controller")
    try:
        children = psutil.Process(stack.pid).children(recursive=True)
        assert any("services.controller.main" in " ".join(p.cmdline()) for p in children), "".join(lines)
        stack.send_signal(signal.SIGINT)
        rest, _ = stack.communicate(timeout=60)
    finally:
        stack.kill()
    assert stack.returncode == 0, "".join(lines) + rest
    assert "started controller-0 " in "".join(lines)
    assert_all_gone(children)
    log_lines = (tmp_path / "logs" / "controller-0.log").read_text()
    assert " I [controller] " in log_lines and " I [controller] " not in "".join(lines) + rest  # info: the log only


# ---------------------------------------------------------------- supervision (the console entry's `make up`)

CRASHER = ServiceSpec(("-c", "import time; time.sleep(0.2); raise SystemExit(3)"))


@pytest.fixture
def server_dir():
    """A data dir for embedded servers outside pytest's temp root: pytest (of any session on the machine) resets
    that root to mode 700, which locks out the `pgserver` user PostgreSQL runs as under root."""
    folder = Path(tempfile.mkdtemp(prefix="fw-stack-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_supervised_stack_restarts_crashed_services_with_backoff(redis_url, database_url, tmp_path, caplog):
    env = {"REDIS_URL": redis_url, "DATABASE_URL": database_url}
    stack = LocalStack(tmp_path, env=env, specs={"probe": PROBE, "crasher": CRASHER},
                       backoff=Backoff(base_s=0.2, cap_s=5.0))
    caplog.set_level(logging.INFO, logger="infra.local.stack")
    try:
        stack.start(["probe"])
        stack.wait_healthy(30)
        stack.supervise(interval_s=0.1)
        probe = stack.instance("probe")
        first_pid = probe.proc.pid
        stack.kill("probe", 0, signal.SIGKILL)
        wait_until(lambda: probe.alive and probe.proc.pid != first_pid, 30, "probe-0 restarted")
        stack.wait_healthy(30)  # on its old port
        assert probe.watch.restarts == 1
        assert "probe-0 exited with code -9" in caplog.text and "probe-0 restarted (restart 1)" in caplog.text

        stack.start(["crasher"])  # joins the supervised stack, then exits with code 3 every time it starts
        crasher = stack.instance("crasher")
        wait_until(lambda: crasher.watch.restarts >= 3, 60, "three restarts of the crash loop")
        delays = [float(m) for m in re.findall(r"crasher-0 exited with code 3.*?restarting it in ([\d.]+)s", caplog.text)]
        assert delays[:3] == [0.2, 0.4, 0.8], caplog.text  # each wait twice the one before
        procs = process_tree(stack)
    finally:
        stack.stop()
    assert_all_gone(procs)


def test_killed_embedded_redis_is_restarted_and_readiness_reports_the_outage(server_dir, monkeypatch, caplog):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    token = "stack-test-token-0123456789"
    # Redis stays down 3 s before its restart: long enough to see every probe say so.
    stack = LocalStack(server_dir, env={"API_TOKEN": token, "HEARTBEAT_INTERVAL_S": "0.5"},
                       specs={"probe": PROBE, "api": SERVICES["api"]}, backoff=Backoff(base_s=3.0))
    caplog.set_level(logging.INFO, logger="infra.local.stack")
    try:
        stack.start()
        stack.wait_healthy(120)
        stack.supervise(interval_s=0.2)
        probe_ready = f"http://127.0.0.1:{stack.instance('probe').port}/readyz"
        api = httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert httpx.get(probe_ready).json() == {"ready": True, "service": "probe", "worker_id": "probe-0",
                                                 "redis": True, "postgres": True}
        engine = create_engine(stack.database_url)
        run_id = uuid.uuid4()
        with engine.begin() as c:
            c.execute(insert(Run).values(id=run_id, name="r", kind="eval", status="running", config={
                "name": "r", "model": "m", "dataset": "d", "agent": {"name": "math"}, "env": {"name": "math"}}))
        engine.dispose()
        assert api.get(f"/v1/runs/{run_id}").json().get("outage") is None
        client = redis.Redis.from_url(stack.redis_url)
        client.xadd("survivor", {"k": "v"})
        time.sleep(1.5)  # appendfsync everysec
        client.close()

        dead = stack.redis.pid
        os.kill(dead, signal.SIGKILL)
        down = wait_until(lambda: (r := httpx.get(probe_ready)).status_code == 503 and r.json(), 10, "probe not ready")
        assert down["redis"] is False and down["postgres"] is True
        assert httpx.get(stack.api_url + "/healthz").status_code == 200  # liveness: the process is fine
        assert httpx.get(stack.api_url + "/readyz").json()["redis"] is False
        shown = api.get(f"/v1/runs/{run_id}").json()
        assert shown["status"] == "running" and "Redis is unreachable" in shown["outage"]

        wait_until(lambda: httpx.get(probe_ready).status_code == 200, 60, "probe ready again", interval_s=0.25)
        # The supervisor counts the restart just after the new Redis is up, so the probe can see it first.
        wait_until(lambda: stack._server_watches["redis"].restarts >= 1, 5, "restart counted", interval_s=0.05)
        assert stack.redis.pid != dead and stack._server_watches["redis"].restarts == 1
        assert "embedded Redis exited with code -9" in caplog.text
        assert redis.Redis.from_url(stack.redis_url).xlen("survivor") == 1  # same address, AOF replayed
        wait_until(lambda: api.get(f"/v1/runs/{run_id}").json().get("outage") is None, 10, "run outage cleared")
        api.close()
        procs = process_tree(stack) + [psutil.Process(stack.redis.pid), psutil.Process(stack.postgres.pid)]
    finally:
        stack.stop()
    assert_all_gone(procs)


def test_console_entry_survives_repeated_sigterm_without_orphans(server_dir):
    """`make up` with embedded servers, then SIGTERM twice (and once more): every service, its children and
    both embedded servers are gone when the stack exits."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    # a short same-signal window: the second SIGTERM must land while the services still stop (about 1 s)
    env.update(DATA_DIR=str(server_dir), API_PORT=str(free_port()), WEIGHT_SERVER_PORT=str(free_port()),
               STACK_SAME_SIGNAL_S="0.05")
    stack, lines = start_console_stack(env, "controller,jobs,api")
    try:
        assert "all services healthy" in lines[-1], "".join(lines)[-4000:]
        procs = psutil.Process(stack.pid).children(recursive=True)
        postmaster = int((server_dir / "postgres" / "postmaster.pid").read_text().split()[0])
        procs.append(psutil.Process(postmaster))
        commands = " ".join(" ".join(p.cmdline()) for p in procs)
        for part in ("services.controller.main", "services.jobs.main", "services.api.main", "redis-server"):
            assert part in commands, commands
        stack.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # past the same-signal window: a second request, not the first delivered twice
        stack.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        stack.send_signal(signal.SIGTERM)
        rest, _ = stack.communicate(timeout=90)
    finally:
        stack.kill()
    output = "".join(lines) + rest
    assert stack.returncode == 0, output[-4000:]
    assert "again: killing the remaining services now" in output, output[-4000:]
    assert_all_gone(procs)


def _embedded_env(server_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(DATA_DIR=str(server_dir), API_PORT=str(free_port()), WEIGHT_SERVER_PORT=str(free_port()),
               STACK_WATCHDOG_GRACE_S="5")
    return env


def _postmaster(server_dir: Path) -> psutil.Process:
    return psutil.Process(int((server_dir / "postgres" / "postmaster.pid").read_text().split()[0]))


def test_a_sigkilled_stack_takes_every_process_it_started_with_it(server_dir):
    """`make up` SIGKILLed (no handler of its own runs): its watchdog stops every service, their children and
    both embedded servers; nothing is left re-parented to init."""
    stack, lines = start_console_stack(_embedded_env(server_dir), "controller,api")
    try:
        assert "all services healthy" in lines[-1], "".join(lines)[-4000:]
        procs = psutil.Process(stack.pid).children(recursive=True) + [_postmaster(server_dir)]
        commands = " ".join(" ".join(p.cmdline()) for p in procs)
        for part in ("services.controller.main", "services.api.main", "redis-server", "infra.local.watchdog", "postgres"):
            assert part in commands, commands
        stack.kill()
        stack.wait()
        wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs), 30,
                   "every process of the killed stack gone")
    finally:
        stack.kill()
    assert_all_gone(procs)
    assert "the stack is gone; stopping what it left" in (server_dir / "logs" / "stack.log").read_text()


def test_make_up_takes_over_servers_a_killed_stack_and_its_watchdog_left_behind(server_dir):
    """The watchdog killed with the stack (kill -9 of both) leaves the embedded servers running on DATA_DIR: the
    next `make up` there shuts the stale Redis down (it saves first) and reuses the PostgreSQL, then stops both."""
    env = _embedded_env(server_dir)
    first, lines = start_console_stack(env, "controller")
    try:
        assert "all services healthy" in lines[-1], "".join(lines)[-4000:]
        children = psutil.Process(first.pid).children(recursive=True)
        stale_redis = next(p for p in children if "redis-server" in p.name())
        stale_postgres = _postmaster(server_dir)
        for p in [psutil.Process(first.pid), *children]:
            if p.pid != stale_redis.pid:
                p.kill()  # the stack, its watchdog and its service: only the servers stay behind
        first.wait()
        time.sleep(0.5)
        assert stale_redis.is_running() and stale_postgres.is_running()
    finally:
        first.kill()
    env["API_PORT"] = str(free_port())
    second, lines = start_console_stack(env, "controller")
    try:
        assert "all services healthy" in lines[-1], "".join(lines)[-4000:]
        assert "from an earlier stack is still running; shutting it down" in "".join(lines)
        assert not stale_redis.is_running() or stale_redis.status() == psutil.STATUS_ZOMBIE
        assert _postmaster(server_dir).pid == stale_postgres.pid  # taken over
        procs = psutil.Process(second.pid).children(recursive=True) + [stale_postgres]
        second.send_signal(signal.SIGINT)
        rest, _ = second.communicate(timeout=90)
    finally:
        second.kill()
    assert second.returncode == 0, "".join(lines) + rest
    assert_all_gone(procs)


def test_make_up_console_shows_what_a_user_acts_on_and_one_signal_to_the_group_stops_once(server_dir, tmp_path):
    """`make up` as a user runs it, with embedded servers and Celery as root: the console has no initdb /
    pg_ctl output and no Celery superuser warning (both in the log files), and one stop request that reaches
    the stack twice (a SIGTERM to the terminal's process group, passed on once more by a wrapper such as make or
    a process supervisor) is one stop, not "SIGTERM again"."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    api_port = free_port()
    env.update(DATA_DIR=str(server_dir), API_PORT=str(api_port), WEIGHT_SERVER_PORT=str(free_port()))
    (tmp_path / "Makefile").write_text(f"up:\n\t{sys.executable} -m infra.local.stack --services jobs,api\n")
    make = subprocess.Popen(["make", "-f", str(tmp_path / "Makefile"), "up"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines = []
    try:
        for line in make.stdout:
            lines.append(line)
            if "all services healthy" in line:
                break
        procs = psutil.Process(make.pid).children(recursive=True)
        stack_pid = next(p.pid for p in procs if "infra.local.stack" in " ".join(p.cmdline()))
        # the jobs service answers /healthz beside Celery's start-up, so Celery's root warning can come after
        # "healthy": wait for it to reach the log file before stopping (then check it never reached the console)
        jobs_log = server_dir / "logs" / "jobs-0.log"
        wait_until(lambda: "superuser privileges" in jobs_log.read_text(), 30, "Celery's root warning in jobs-0.log")
        os.killpg(make.pid, signal.SIGTERM)  # what a supervisor's stop does to the group
        os.kill(stack_pid, signal.SIGTERM)  # and the same request passed on to the stack by its parent
        rest, _ = make.communicate(timeout=90)
    finally:
        make.kill()
    console = "".join(lines) + rest
    api_url = f"http://127.0.0.1:{api_port}"  # on API_PORT, and how the CLI elsewhere follows it
    assert f"all services healthy; API at {api_url} (CLI: export FLYWHEEL_API_URL={api_url})" in console, console
    assert f"FLYWHEEL_API_URL='{api_url}'" in (server_dir / "stack.env").read_text()
    assert "again" not in console and "SIGTERM: stopping every service" in console, console[-4000:]
    for noise in ("initdb", "pg_ctl", "Running commandline", "superuser privileges", "XDG_RUNTIME_DIR"):
        assert noise not in console, (noise, console[-4000:])
    assert len(console.splitlines()) <= 20, console  # started x N, healthy, stopping, stopped
    assert "initdb" in (server_dir / "logs" / "stack.log").read_text()  # kept, in the log file
    assert "superuser privileges" in jobs_log.read_text()
    assert_all_gone(procs)


def test_a_worker_started_by_hand_joins_a_running_stack(server_dir, monkeypatch):
    """docs/deploy.md's recipe: source $DATA_DIR/stack.env in another shell and start one more process."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with LocalStack(server_dir, specs={"probe": PROBE}) as stack:
        stack.start()
        stack.wait_healthy(60)
        assert stack.env_file.stat().st_mode & 0o077 == 0
        env = {**os.environ, "PROBE_CODE": PROBE.args[1], "PY": sys.executable}
        extra = subprocess.Popen(
            ["bash", "-c", f'set -a; . "{stack.env_file}"; set +a; WORKER_ID=probe-extra exec "$PY" -c "$PROBE_CODE"'],
            cwd=Path(__file__).resolve().parents[2], env=env,
        )
        try:
            client = redis.Redis.from_url(stack.redis_url)
            assert wait_until(lambda: client.exists(heartbeat_key("probe", "probe-extra")), 30, "the extra heartbeat")
        finally:
            extra.terminate()
            extra.wait(30)


def test_killed_embedded_postgres_is_restarted_at_the_same_address(server_dir, monkeypatch, caplog):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    caplog.set_level(logging.INFO, logger="infra.local.stack")
    with LocalStack(server_dir, specs={"probe": PROBE}, backoff=Backoff(base_s=3.0)) as stack:
        stack.start()
        stack.wait_healthy(60)
        stack.supervise(interval_s=0.2)
        probe_ready = f"http://127.0.0.1:{stack.instance('probe').port}/readyz"
        url, dead = stack.database_url, stack.postgres.pid
        os.kill(dead, signal.SIGKILL)
        down = wait_until(lambda: (r := httpx.get(probe_ready)).status_code == 503 and r.json(), 10, "probe not ready")
        assert down["postgres"] is False and down["redis"] is True
        wait_until(lambda: stack.postgres.alive and stack.postgres.pid != dead, 90, "PostgreSQL restarted", interval_s=0.25)
        wait_until(lambda: httpx.get(probe_ready).status_code == 200, 30, "probe ready again", interval_s=0.25)
        engine = create_engine(url)  # the address the services were given
        try:
            with Session(engine) as s:
                assert s.scalar(select(Dataset).limit(1)) is None  # migrated schema, still there
        finally:
            engine.dispose()
        assert "embedded PostgreSQL (postmaster pid" in caplog.text and "embedded PostgreSQL restarted" in caplog.text


def test_a_redis_left_by_a_killed_stack_is_shut_down_cleanly_by_the_next(server_dir):
    first = RedisServer(server_dir / "redis", unix_socket=True)
    first.start()
    client = redis.Redis.from_url(first.url)
    client.set("kept", "1")
    orphan = psutil.Process(first.pid)
    second = RedisServer(server_dir / "redis", unix_socket=True)
    second.start()  # the first stack died without stopping its server
    try:
        assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE
        assert second.url == first.url and redis.Redis.from_url(second.url).get("kept") == b"1"  # saved on SIGTERM
    finally:
        second.stop()
        first.stop()
