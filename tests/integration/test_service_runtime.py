"""The service runtime (shared/service.py) in process, on real Redis: a stop lets the HTTP requests in flight
finish, then runs the `on_stop` cleanups, the last registered first; the heartbeat key is there while it runs
and gone after."""

from __future__ import annotations

import asyncio

import httpx

from shared.service import ServiceRuntime
from shared.settings import ServiceSettings
from shared.streams import heartbeat_key


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
