"""A long-lived rollout worker releases the engines of runs it has had no task for (each can hold a model),
never one with a task running or a reload under way, and builds a released run again when its tasks return."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from services.rollout_worker.run_engines import RunContext, RunRegistry


class Engine:
    def __init__(self):
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def _ctx(run_id: str, idle_s: float) -> RunContext:
    return RunContext(run_id, None, None, Engine(), None, None, asyncio.Lock(), last_used=time.monotonic() - idle_s)


async def test_idle_runs_are_released_busy_ones_kept_and_rebuilt_on_return(monkeypatch, tmp_path: Path):
    registry = RunRegistry(db=None, weights_cache=tmp_path, hf_batch_wait_ms=0)
    old, busy, fresh, reloading = _ctx("old", 900), _ctx("busy", 900), _ctx("fresh", 10), _ctx("reloading", 900)
    registry.contexts = {c.run_id: c for c in (old, busy, fresh, reloading)}
    await reloading.reload_lock.acquire()  # a weight reload is under way

    with busy.in_use():
        assert await registry.evict_idle(600) == ["old"]
    assert old.engine.closed and not busy.engine.closed and not fresh.engine.closed
    assert set(registry.contexts) == {"busy", "fresh", "reloading"}
    assert busy.running == 0 and time.monotonic() - busy.last_used < 5  # the task's end counts as use

    builds = []

    async def build(run_id: str) -> RunContext:
        builds.append(run_id)
        return _ctx(run_id, 0)

    async def load_newest(ctx: RunContext) -> None:
        pass

    monkeypatch.setattr(registry, "build", build)
    monkeypatch.setattr(registry, "load_newest", load_newest)
    again = await registry.get("old")  # its tasks came back
    assert builds == ["old"] and again is registry.contexts["old"] and not again.engine.closed
    assert await registry.get("old") is again and builds == ["old"]  # cached again
