"""The mock LLM (tests/support/mock_llm.py, a process) speaks the reload protocol the openai engine speaks to a real vLLM
server: a full reload and a weight delta both succeed against it and relabel what it serves. The benchmarks and
chaos tests that hot-reload a rollout worker against the mock rely on this; a mock that drifts from the engine
would make every reload there fail while the run still trains."""

from __future__ import annotations

import torch
from fixtures.weight_deltas import load_update, step, write_delta

from infra.local.ports import free_port
from services.rollout_worker.engines import SamplingParams, build_engine
from shared.contracts.run_config import EngineConfig
from shared.weights.delta import read_safetensors
from tests.support.live import start_mock_llm
from tests.support.tiny_model import build_tiny_model


async def test_full_reload_and_delta_against_the_mock_relabel_what_it_serves(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    mock = start_mock_llm(port, latency_ms=1)
    engine = build_engine("openai", str(model), EngineConfig(type="openai", base_url=f"http://127.0.0.1:{port}/v1"),
                          tokenizer=None, initial_version=0, scratch_dir=tmp_path / "scratch")
    try:
        greedy = SamplingParams(temperature=0.0)
        assert (await engine.generate([1, 2, 3], greedy, 4)).weight_version == 0
        await engine.load_weights(model, 1)
        assert engine.version == 1 and (await engine.generate([1, 2, 3], greedy, 4)).weight_version == 1

        state = read_safetensors(model)
        files = write_delta(tmp_path, 2, state, step(state, torch.Generator().manual_seed(0)))
        await engine.apply_update(load_update(files))
        assert engine.version == 2 and (await engine.generate([1, 2, 3], greedy, 4)).weight_version == 2
    finally:
        await engine.close()
        mock.terminate()
        mock.wait(10)
