"""ReloadGate, the drain-then-swap shared by the vllm and openai engines: a reload waits for the requests in
flight, and no request starts while a reload runs, so every request sees one version from start to end."""

from __future__ import annotations

import asyncio

from services.rollout_worker.engines.base import ReloadGate


async def _settle() -> None:
    for _ in range(20):  # enough loop turns for every runnable task to reach its next real wait
        await asyncio.sleep(0)


class Server:
    """A toy engine: requests read the version on entry and again on exit; a reload swaps it."""

    def __init__(self) -> None:
        self.gate = ReloadGate()
        self.version = 0
        self.log: list[str] = []

    async def generate(self, name: str, hold: asyncio.Event) -> tuple[int, int]:
        async with self.gate.request():
            start = self.version
            self.log.append(f"{name} start")
            await hold.wait()
            self.log.append(f"{name} end")
            return start, self.version

    async def reload(self, version: int, hold: asyncio.Event) -> None:
        async with self.gate.reload():
            self.log.append("reload start")
            await hold.wait()
            self.version = version
            self.log.append("reload end")


async def test_a_reload_waits_for_requests_in_flight_and_they_keep_their_version():
    server, hold_a, hold_b, go = Server(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    go.set()
    a = asyncio.create_task(server.generate("a", hold_a))
    b = asyncio.create_task(server.generate("b", hold_b))
    await _settle()
    assert server.gate.in_flight == 2
    reload = asyncio.create_task(server.reload(1, go))
    await _settle()
    assert "reload start" not in server.log  # two requests are still in flight
    hold_a.set()
    await _settle()
    assert "reload start" not in server.log  # one still is
    hold_b.set()
    await reload
    assert await a == (0, 0) and await b == (0, 0)
    assert server.log == ["a start", "b start", "a end", "b end", "reload start", "reload end"]


async def test_no_request_starts_while_a_reload_runs():
    server, hold_reload, go = Server(), asyncio.Event(), asyncio.Event()
    go.set()
    reload = asyncio.create_task(server.reload(1, hold_reload))
    await _settle()
    late = [asyncio.create_task(server.generate(f"late{i}", go)) for i in range(3)]
    await _settle()
    assert server.log == ["reload start"] and server.gate.in_flight == 0  # the requests wait at the gate
    hold_reload.set()
    await reload
    assert [await t for t in late] == [(1, 1)] * 3  # and start on the new version
    assert server.log[:2] == ["reload start", "reload end"]


async def test_the_gate_reopens_after_a_failed_reload():
    server, go = Server(), asyncio.Event()
    go.set()

    async def failing() -> None:
        async with server.gate.reload():
            raise RuntimeError("swap failed")

    try:
        await failing()
    except RuntimeError:
        pass
    assert await asyncio.wait_for(server.generate("after", go), 1) == (0, 0)
