"""The service runtime (shared/platform/service.py) on real Redis: a stop lets the HTTP requests in flight
finish, then runs the `on_stop` cleanups, the last registered first; the heartbeat key is there while it runs
and gone after; its port is held from construction, and a dead HTTP server ends it. And in a process of its own:
a loop that dies beside a foreground framework stops the process. And `free_port`'s picks for such processes."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import httpx
import pytest

from shared.contracts.streams import heartbeat_key
from shared.platform.service import ServiceRuntime
from shared.platform.settings import ServiceSettings


async def wait_serving(client: httpx.AsyncClient, runtime: ServiceRuntime) -> str:
    for _ in range(100):
        if runtime.port:
            try:
                if (await client.get(f"http://127.0.0.1:{runtime.port}/healthz")).status_code == 200:
                    return f"http://127.0.0.1:{runtime.port}"
            except httpx.TransportError:
                pass
        await asyncio.sleep(0.05)
    raise TimeoutError("the runtime did not serve /healthz")


async def test_stop_drains_requests_then_runs_cleanups_last_registered_first(redis_url, redis_client):
    runtime = ServiceRuntime(ServiceSettings(redis_url=redis_url, health_host="127.0.0.1", worker_id="rt-1"),
                             "probe", dependencies=("redis",), handle_signals=False)
    order: list[str] = []

    @runtime.app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(1.0)
        order.append("request finished")
        return {"ok": True}

    async def close_last_registered() -> None:
        order.append("last registered")

    runtime.on_stop(lambda: order.append("first registered"))
    runtime.on_stop(close_last_registered)
    served = asyncio.create_task(runtime.run([]))
    async with httpx.AsyncClient(timeout=10) as client:
        url = await wait_serving(client, runtime)
        for _ in range(40):
            if await redis_client.exists(heartbeat_key("probe", "rt-1")):
                break
            await asyncio.sleep(0.05)
        assert await redis_client.exists(heartbeat_key("probe", "rt-1"))
        request = asyncio.create_task(client.get(f"{url}/slow"))
        await asyncio.sleep(0.3)
        runtime.stop.set()
        assert (await request).status_code == 200
    assert await served == 0
    assert order == ["request finished", "last registered", "first registered"]
    assert not await redis_client.exists(heartbeat_key("probe", "rt-1"))


async def test_the_port_is_held_from_construction_and_a_taken_one_is_a_clear_error(redis_url):
    runtime = ServiceRuntime(ServiceSettings(redis_url=redis_url, health_host="127.0.0.1"), "probe",
                             dependencies=("redis",), handle_signals=False)
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", runtime.port))  # taken before the service has built anything or served
    with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{runtime.port} .*HEALTH_PORT"):
        ServiceRuntime(ServiceSettings(redis_url=redis_url, health_host="127.0.0.1", health_port=runtime.port),
                       "probe", dependencies=("redis",), handle_signals=False)
    assert taken.value.errno is not None
    runtime.stop.set()
    assert await runtime.run([]) == 0


async def test_a_dead_http_server_ends_the_service_with_an_error(redis_url):
    runtime = ServiceRuntime(ServiceSettings(redis_url=redis_url, health_host="127.0.0.1"), "probe",
                             dependencies=("redis",), handle_signals=False)
    loop_ran = asyncio.Event()

    async def server_that_dies() -> None:
        await loop_ran.wait()
        raise RuntimeError("the HTTP server died")

    runtime._serve_http = server_that_dies

    async def forever() -> None:
        loop_ran.set()
        await asyncio.Event().wait()

    assert await asyncio.wait_for(runtime.run([forever()]), 30) == 1
    assert loop_ran.is_set()


def test_free_port_picks_in_turn_below_the_ephemeral_range_and_skips_taken_ports():
    from infra.local import ports

    first_ephemeral = ports._first_ephemeral_port()
    script = "from infra.local.ports import free_port; print(*(free_port() for _ in range(20)))"
    picks = [int(p) for _ in range(3)
             for p in subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                     text=True).stdout.split()]
    assert len(set(picks)) == 60, "processes picking in turn got the same port"
    assert all(first_ephemeral - ports.POOL <= p < first_ephemeral for p in picks)
    with socket.socket() as held:
        held.bind(("127.0.0.1", picks[-1] + 1))  # the next one in turn, unless it wrapped
        assert ports.free_port() != picks[-1] + 1


async def test_the_heartbeat_says_when_postgres_does_not_answer(redis_url, redis_client, database_url):
    """A process that depends on Postgres says in its heartbeat whether Postgres answers it (others cannot see
    its connections): `unreachable: ["postgres"]` while it does not, nothing once it does."""
    import json

    from infra.local.ports import free_port

    async def beat(worker: str) -> dict:
        for _ in range(100):
            if raw := await redis_client.get(heartbeat_key("probe", worker)):
                return json.loads(raw)
            await asyncio.sleep(0.05)
        raise TimeoutError("no heartbeat")

    beats = {}
    for worker, url in (("rt-pg-down", f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres"),
                        ("rt-pg-up", database_url)):
        runtime = ServiceRuntime(ServiceSettings(redis_url=redis_url, database_url=url, health_host="127.0.0.1",
                                                 worker_id=worker), "probe", dependencies=("redis", "postgres"),
                                 handle_signals=False)
        served = asyncio.create_task(runtime.run([]))
        beats[worker] = await beat(worker)
        runtime.stop.set()
        assert await served == 0
    assert beats["rt-pg-down"]["unreachable"] == ["postgres"]
    assert "unreachable" not in beats["rt-pg-up"]


FOREGROUND_PROGRAM = """
import signal, sys, threading
from shared.platform.service import run_service
from shared.platform.settings import ServiceSettings

async def build(settings, runtime):
    async def dies():
        raise RuntimeError("the intake died")
    return [dies()]

def foreground(settings):  # a framework's main loop (Celery's): runs until SIGTERM
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait(60)
    print("foreground stopped by SIGTERM" if stopped.is_set() else "foreground ran on", flush=True)

sys.exit(run_service(ServiceSettings(redis_url=sys.argv[1], health_host="127.0.0.1", health_port=0,
                                     worker_id="rt-fg", service_name="probe"),
                     build, dependencies=("redis",), foreground=foreground))
"""


def test_a_loop_that_dies_beside_a_foreground_stops_the_process(redis_url):
    """run_service's guarantee: a runtime that stops on its own (a loop died) sends its process SIGTERM, so a
    foreground framework (the jobs service's Celery worker) does not go on without its loops (the intake)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FOREGROUND_PROGRAM, redis_url], capture_output=True, text=True,
                          timeout=60)
    assert "foreground stopped by SIGTERM" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1, done.stderr  # the loop's failure is the process's exit code
