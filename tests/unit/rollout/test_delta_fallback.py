"""A delta the engine fails to apply, for whatever reason, is followed at once by the full weights of that version:
the engine may hold part of the delta (a server that loaded some layers), and the version must not be skipped."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

import services.rollout_worker.run_engines as runs
from services.rollout_worker.engines import InferenceError
from shared.contracts.messages import WeightsPublished
from shared.weights.manifest import CheckpointManifest, ChecksumError


class Engine:
    supports_update = True

    def __init__(self, error: Exception):
        self.version, self.error, self.loaded = 1, error, []

    async def apply_update(self, update):
        raise self.error

    async def load_weights(self, folder, version):
        self.loaded.append((folder, version))
        self.version = version


def reloads(result: str) -> float:
    return REGISTRY.get_sample_value("rollout_weight_reloads_total", {"outcome": result}) or 0.0


@pytest.mark.parametrize(("error", "counted"), [(InferenceError("server could not read the delta"), "delta_failed"),
                                                (ChecksumError("digest mismatch"), "delta_rejected")])
async def test_a_failed_delta_falls_back_to_the_full_weights_of_its_version(monkeypatch, tmp_path, error, counted):
    delta = CheckpointManifest(run_id="r", version=2, files={}, kind="delta", base_version=1)
    monkeypatch.setattr(runs, "fetch_manifest", lambda msg: delta)
    monkeypatch.setattr(runs, "materialize", lambda msg, cache, relay=None: tmp_path / "full-v2")
    registry = runs.RunRegistry(db=None, weights_cache=tmp_path, hf_batch_wait_ms=0)
    monkeypatch.setattr(registry, "_update", lambda msg, manifest: object())
    engine, before = Engine(error), reloads(counted)
    msg = WeightsPublished(run_id="r", version=2, uri="http://w/r/2", sha256="0" * 64, bytes=0, created_at=0.0)
    await registry._load(SimpleNamespace(engine=engine, run_id="r"), msg)
    assert engine.loaded == [(Path(tmp_path / "full-v2"), 2)] and engine.version == 2
    assert reloads(counted) == before + 1


async def test_an_announcement_for_a_run_not_served_here_is_counted_and_kept_for_its_first_build(tmp_path):
    registry = runs.RunRegistry(db=None, weights_cache=tmp_path, hf_batch_wait_ms=0)
    before = REGISTRY.get_sample_value("rollout_weight_announcements_total", {"served": "no"}) or 0.0
    msg = WeightsPublished(run_id="elsewhere", version=3, uri="http://w/e/3", sha256="0" * 64, bytes=0, created_at=0.0)
    await registry.on_weights(msg)
    assert REGISTRY.get_sample_value("rollout_weight_announcements_total", {"served": "no"}) == before + 1
    assert registry.announced["elsewhere"] == msg  # what load_newest picks from when the run's first task comes
