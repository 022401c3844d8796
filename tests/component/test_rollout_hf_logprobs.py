"""The HF engine's logprobs have the meaning every engine shares: the distribution each token was sampled
from (temperature, then top-k and top-p), checked against a plain forward pass (tests/fixtures/vllm_env.py's
reference, which also checks vLLM's)."""

import asyncio

import pytest
from fixtures.vllm_env import check_top_and_prompt_logprobs, reference_logprobs

from services.rollout_worker.engines import SamplingParams, build_engine
from shared.contracts.run_config import EngineConfig
from tests.support.tiny_model import build_tiny_model


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9)])
async def test_hf_logprobs_are_of_the_sampling_distribution(tmp_path, temperature, top_k, top_p):
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path / "m", initializer_range=0.1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = build_engine("hf", str(model), EngineConfig(), tokenizer, batch_wait_ms=0)
    prompt = [5, 6, 7, 8]
    try:
        gen = await engine.generate(prompt, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), 12)
    finally:
        await engine.close()
    ref = reference_logprobs(model, prompt, gen.ids, temperature=temperature, top_k=top_k, top_p=top_p)
    assert gen.logprobs == pytest.approx(ref, abs=1e-5)


async def test_hf_top_k_and_prompt_logprobs(tmp_path):
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path / "m", initializer_range=0.1)
    engine = build_engine("hf", str(model), EngineConfig(), AutoTokenizer.from_pretrained(model), batch_wait_ms=0)
    prompt = [5, 6, 7, 8, 9]
    try:
        gen = await engine.generate(prompt, SamplingParams(temperature=0.7, top_k=3, logprobs=5, prompt_logprobs=4), 8)
        plain = await engine.generate(prompt, SamplingParams(), 4)
    finally:
        await engine.close()
    check_top_and_prompt_logprobs(gen, model, prompt, k=5, prompt_k=4, kept=3)
    assert plain.top_logprobs is None and plain.prompt_logprobs is None  # only what was asked for


async def test_a_sampled_pad_token_is_not_read_as_a_stop_strings_end(tmp_path):
    """generate pads a row that a stop string ended, with the pad token, which a model may also sample: a sample
    is cut only where a stop string ended it (the cookbook asserts every sample has tokens and logprobs)."""
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = build_engine("hf", str(model), EngineConfig(), tokenizer, batch_wait_ms=0)
    pad, stop_token = tokenizer.pad_token_id, 40
    stop = (tokenizer.decode([stop_token]),)
    try:
        ids = [pad, 7, stop_token, pad, pad]  # a sampled pad, then the stop string, then generate's padding
        assert engine._cut(ids, [-1.0] * 5, 5, stop) == (ids[:3], [-1.0] * 3, "stop")
        sampled = [pad, 7, 8, 9]  # a sampled pad and no stop string: the whole sample, cut by max_tokens
        assert engine._cut(sampled, [-1.0] * 4, 4, stop) == (sampled, [-1.0] * 4, "length")
    finally:
        await engine.close()


async def test_hf_seeded_requests_draw_the_same_samples_whatever_runs_beside_them(tmp_path):
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path / "m", initializer_range=0.1)
    engine = build_engine("hf", str(model), EngineConfig(), AutoTokenizer.from_pretrained(model), batch_wait_ms=5)
    prompt, seeded = [5, 6, 7, 8], SamplingParams(seed=7)
    try:
        alone = await engine.generate(prompt, seeded, 12)
        # the same request among unseeded ones and other seeds, all sent at once
        together = await asyncio.gather(engine.generate(prompt, seeded, 12), *(
            engine.generate(prompt, SamplingParams(seed=s), 12) for s in (8, 9)),
            *(engine.generate(prompt, SamplingParams(), 12) for _ in range(3)))
    finally:
        await engine.close()
    assert together[0].ids == alone.ids and together[0].logprobs == pytest.approx(alone.logprobs, abs=1e-6)
    assert len({tuple(g.ids) for g in together[:3]}) > 1  # other seeds, other draws


async def test_a_request_cancelled_before_its_batch_starts_is_not_generated(tmp_path):
    """A cancelled sample's generate (its caller stopped waiting) is dropped from the queue: the batch that runs
    holds only the requests still awaited."""
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path / "m")
    engine = build_engine("hf", str(model), EngineConfig(), AutoTokenizer.from_pretrained(model), batch_wait_ms=200)
    batches: list[int] = []
    generate_batch = engine._generate_batch
    engine._generate_batch = lambda batch, *a: batches.append(len(batch)) or generate_batch(batch, *a)
    try:
        kept = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(), 4))
        dropped = asyncio.ensure_future(engine.generate([5, 6, 8], SamplingParams(), 4))
        await asyncio.sleep(0.05)  # both queued, the batch not yet taken (it waits 200 ms for requests to join)
        dropped.cancel()
        assert len((await kept).ids) >= 1
    finally:
        await engine.close()
    assert batches == [1]
