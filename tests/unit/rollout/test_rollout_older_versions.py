"""A LoRA run's older version (a Tinker sampler of a model's earlier sampler weights) is served by an adapter of
its own beside the newest: loaded once, reused, the least recently used dropped beyond OLDER_VERSIONS_MAX but never
one serving a request, refused with the reason once the weight server no longer keeps it, released with its run."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.rollout_worker import run_engines
from services.rollout_worker.engines import AdapterView
from services.rollout_worker.run_engines import OLDER_VERSIONS_MAX, RunContext, RunRegistry
from shared.contracts.messages import WeightsPublished


class Base:
    """A base engine's adapter bookkeeping: adapter key -> version."""

    def __init__(self):
        self.adapters: dict[str, int] = {}
        self.loads: list[tuple[str, int]] = []

    def adapter_version(self, key: str) -> int:
        return self.adapters.get(key, 0)

    async def load_adapter(self, key: str, folder: Path, version: int, base_model) -> None:
        self.loads.append((key, version))
        self.adapters[key] = version

    async def remove_adapter(self, key: str) -> None:
        self.adapters.pop(key)

    async def close(self) -> None:
        pass


@pytest.fixture
def registry(monkeypatch, tmp_path: Path) -> RunRegistry:
    registry = RunRegistry(db=None, weights_cache=tmp_path, hf_batch_wait_ms=0)
    kept = set(range(1, 30))  # versions the weight server still has

    def checkpoint(run_id: str, version: int | None = None):
        if version not in kept:
            return None
        return WeightsPublished(run_id=run_id, version=version, uri=f"http://ws/{version}", path=None,
                                sha256="0" * 64, bytes=1, created_at=time.time())

    monkeypatch.setattr(registry, "checkpoint", checkpoint)
    monkeypatch.setattr(registry, "_manifest", lambda msg: SimpleNamespace(base_model="base"))
    monkeypatch.setattr(run_engines, "materialize", lambda msg, cache, relay=None: cache / f"v{msg.version}")
    registry.kept = kept
    return registry


def lora_run(registry: RunRegistry, base: Base, version: int) -> RunContext:
    view = AdapterView(base, "run")
    base.adapters["run"] = version
    ctx = RunContext("run", None, None, view, None, None, asyncio.Lock())
    registry.contexts["run"] = ctx
    return ctx


async def test_an_older_version_is_its_own_adapter_loaded_once_beside_the_newest(registry):
    base = Base()
    ctx = lora_run(registry, base, 5)
    older = await registry.older_version(ctx, 3)
    assert older.engine.version == 3 and ctx.engine.version == 5  # the newest still serves the run
    assert await registry.older_version(ctx, 3) is older and base.loads == [("run-v3", 3)]  # reused, not reloaded


async def test_the_least_recently_used_are_dropped_but_never_one_serving(registry):
    base = Base()
    ctx = lora_run(registry, base, 100)
    serving = await registry.older_version(ctx, 1)
    with serving.in_use():
        for v in range(2, OLDER_VERSIONS_MAX + 4):
            await registry.older_version(ctx, v)
        assert len(registry.older) == OLDER_VERSIONS_MAX
        assert ("run", 1) in registry.older and base.adapters["run-v1"] == 1  # in use: kept
        assert ("run", 2) not in registry.older and "run-v2" not in base.adapters  # least recently used: dropped
    kept = sorted(v for _, v in registry.older)
    assert kept == [1, *range(OLDER_VERSIONS_MAX + 5 - OLDER_VERSIONS_MAX, OLDER_VERSIONS_MAX + 4)]


async def test_one_asked_for_while_all_serve_is_loaded_beyond_the_bound(registry):
    base = Base()
    ctx = lora_run(registry, base, 100)
    busy = [await registry.older_version(ctx, v) for v in range(1, OLDER_VERSIONS_MAX + 1)]
    for c in busy:
        c.running += 1  # each serving a request
    extra = await registry.older_version(ctx, 20)
    assert extra.engine.version == 20 and base.adapters["run-v20"] == 20  # returned loaded, not dropped
    assert len(registry.older) == OLDER_VERSIONS_MAX + 1 and all(c.engine.version for c in busy)


async def test_a_version_the_weight_server_dropped_or_a_full_weight_run_is_refused_with_the_reason(registry):
    base = Base()
    ctx = lora_run(registry, base, 5)
    registry.kept.discard(2)
    with pytest.raises(LookupError, match="KEEP_LAST"):
        await registry.older_version(ctx, 2)

    class FullWeights:
        version = 5
    full = RunContext("full", None, None, FullWeights(), None, None, asyncio.Lock())
    with pytest.raises(ValueError, match="full weights"):
        await registry.older_version(full, 3)


async def test_older_versions_go_with_their_run(registry):
    base = Base()
    ctx = lora_run(registry, base, 5)
    await registry.older_version(ctx, 3)
    await registry.older_version(ctx, 4)
    await registry.forget("run")
    assert registry.older == {} and base.adapters == {}
