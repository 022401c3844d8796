"""Partial rollouts on the HF engine: a generation in flight when a new version loads continues on the new
weights from the next decode chunk, each token tagged with the version that produced it and its logprob that
version's; then trained with a per-token importance weight and its oldest token's staleness."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from fixtures.vllm_env import reference_logprobs

from services.rollout_worker.assembly import assemble
from services.rollout_worker.engines import SamplingParams, build_engine
from services.trainer.algorithm import rollout_correction
from services.trainer.batch import Group, build_tensors, samples_from_result, select_groups
from shared.contracts.messages import EpisodeResult, TrajectoryRecord
from shared.contracts.run_config import AlgorithmConfig, EngineConfig
from shared.sdk.types import Step, Trajectory
from tests.support.tiny_model import build_tiny_model

CHUNK = 4


async def generate_across_a_swap(tmp_path, partial: bool):
    """Generate 24 tokens; once the first decode chunk (or, without partial rollouts, the whole generation) is
    under way, load version 1. The engine's thread is held after its first generate call until the swap is
    waiting for the engine, so where the swap lands does not depend on timing."""
    from transformers import AutoTokenizer

    v0, v1 = build_tiny_model(tmp_path / "v0", initializer_range=0.1), \
        build_tiny_model(tmp_path / "v1", initializer_range=0.1, seed=1)
    engine = build_engine("hf", str(v0), EngineConfig(partial_chunk_tokens=CHUNK), AutoTokenizer.from_pretrained(v0),
                          batch_wait_ms=0)
    first_call, go, generate_batch = threading.Event(), threading.Event(), engine._generate_batch

    def held(*args, **kwargs):
        out = generate_batch(*args, **kwargs)
        if not first_call.is_set():
            first_call.set()
            go.wait(30)
        return out

    engine._generate_batch = held
    torch.manual_seed(0)
    prompt = [5, 6, 7, 8]
    try:
        gen = asyncio.create_task(engine.generate(prompt, SamplingParams(partial=partial), 24))
        await asyncio.to_thread(first_call.wait, 30)
        swap = asyncio.create_task(engine.load_weights(v1, 1))
        for _ in range(300):  # until the swap waits for the engine
            if engine._lock._waiters:
                break
            await asyncio.sleep(0.01)
        go.set()
        out = await gen
        await swap
    finally:
        await engine.close()
    return out, prompt, v0, v1


async def test_a_generation_continues_on_the_new_version_token_by_token(tmp_path):
    gen, prompt, v0, v1 = await generate_across_a_swap(tmp_path, partial=True)
    assert len(gen.ids) == 24, "the seeded sample must not stop early"
    assert gen.versions == [0] * CHUNK + [1] * (24 - CHUNK) and gen.weight_version == 0
    head, tail = gen.ids[:CHUNK], gen.ids[CHUNK:]
    assert gen.logprobs[:CHUNK] == pytest.approx(reference_logprobs(v0, prompt, head, temperature=1.0), abs=1e-5)
    assert gen.logprobs[CHUNK:] == pytest.approx(reference_logprobs(v1, prompt + head, tail, temperature=1.0),
                                                 abs=1e-5)


async def test_without_partial_rollouts_the_generation_ends_on_the_version_it_began_on(tmp_path):
    gen, prompt, v0, _ = await generate_across_a_swap(tmp_path, partial=False)
    assert gen.versions is None and gen.weight_version == 0
    assert gen.logprobs == pytest.approx(reference_logprobs(v0, prompt, gen.ids, temperature=1.0), abs=1e-5)


def test_a_two_version_trajectory_trains_with_per_token_weights_and_its_oldest_tokens_staleness():
    """Tagged token by token through assembly and the wire; each token's importance weight uses its own
    behaviour logprob; the sample's staleness is its oldest token's."""
    step = Step(prompt_ids=[1, 2], response_ids=[3, 4, 5, 6], logprobs=[-1.0, -1.0, -2.0, -2.0], weight_version=0,
                response_versions=[0, 0, 1, 1])
    traj = Trajectory(steps=[step], reward=1.0)
    traj.tokens = assemble(traj.steps)
    assert traj.tokens.versions == [0, 0, 1, 1]
    record = TrajectoryRecord.from_trajectory(traj)
    assert record.policy_versions == (0, 1)
    result = EpisodeResult(run_id="r", task_id="t", sample_idx=0, status="completed", termination_reason="env_done",
                           reward=1.0, trajectories=[record])
    [sample] = samples_from_result(result)
    assert sample.min_version == 0
    t = build_tensors([Group(("t", 0), {(0, 0): sample})], pad_id=0)
    assert t["behaviour_versions"][0].tolist() == [0, 0, 1, 1]
    old = torch.tensor([[-1.5, -1.5, -1.5, -1.5]])  # the trainer's policy before its step
    weights, _, _ = rollout_correction(old, t["behaviour_log_probs"], t["response_mask"], AlgorithmConfig(is_cap=2.0))
    # exp(-1.5 - (-1)) for version 0's tokens, exp(-1.5 - (-2)) for version 1's
    assert weights[0].tolist() == pytest.approx([0.6065, 0.6065, 1.6487, 1.6487], abs=1e-4)
    chosen, dropped = select_groups([Group(("t", 0), {(0, 0): sample})], 1, dynamic_sampling=False, version=2,
                                    max_staleness=1, stale_policy="drop")
    assert not chosen and len(dropped["stale"]) == 1  # its newest token is 1 version old, its oldest 2
