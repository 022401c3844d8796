"""Multi-turn episodes from a real rollout worker (HF engine, tiny number model) and env worker, trained on by the
trainer's own code: env tokens never get loss or advantage, every model token's behaviour logprob is that token's
under the weights that generated it (an HF forward pass of the whole episode per version), and an episode whose
turns two policy versions generated carries both and is corrected token by token.

The episode: the built-in digits env's three turns, paused after the first (tests/fixtures/fw_user_plugins.py:
PausingDigitsEnv) while version 1 is published, so turn 1 comes from version 0 and turns 2 and 3 from version 1."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import torch
from fixtures.rollout_stack import (
    collect_results,
    insert_run,
    make_task,
    publish_tasks,
    run_config,
    weights_published,
)

from services.jobs.builtin_datasets import generate
from shared.contracts.streams import WEIGHTS
from shared.platform.bus import StreamBus, connect
from shared.weights.manifest import write_manifest
from tests.support.procs import start_service, stop, wait_heartbeat
from tests.support.tiny_model import build_number_model

MAX_TOKENS = 3  # per turn: turns of several tokens, some ending with the model's own EOS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    v0, v1 = build_number_model(root / "v0", seed=0), build_number_model(root / "v1", seed=1)
    ckpt = root / "ckpt-v1"
    shutil.copytree(v1, ckpt)
    _, sha = write_manifest(ckpt, "x", 1)
    return {"v0": v0, "v1": v1, "ckpt": ckpt, "sha": sha}


@pytest.fixture(scope="module")
def episode(models, redis_url, database_url, tmp_path_factory):
    """(EpisodeResult of the two-version episode, the tokenizer)."""
    from transformers import AutoTokenizer

    data = tmp_path_factory.mktemp("rollout")
    env = start_service("services.env_worker.main", redis_url=redis_url, worker_id="env-mt")
    worker = start_service("services.rollout_worker.main", redis_url=redis_url, database_url=database_url,
                           worker_id="rollout-mt", data_dir=str(data), max_concurrency="8")
    try:
        wait_heartbeat(redis_url, "env-worker", "env-mt", env)
        wait_heartbeat(redis_url, "rollout-worker", "rollout-mt", worker)
        result = asyncio.run(two_version_episode(redis_url, database_url, models, data))
    finally:
        print((stop(worker) + stop(env))[-5000:])
    return result, AutoTokenizer.from_pretrained(models["v0"])


async def two_version_episode(redis_url: str, database_url: str, models: dict, data: Path):
    redis = connect(redis_url)
    try:
        config = run_config(str(models["v0"]), agent={"name": "digits"}, env={"name": "fw_user_plugins:PausingDigitsEnv"},
                            dataset="digits", max_steps=3, max_response_tokens=MAX_TOKENS, max_prompt_tokens=64,
                            env_step_timeout_s=90, trajectory_timeout_s=180)
        run_id = insert_run(database_url, config)
        rows = generate("digits", 20, seed=3)
        paused, resume = data / "paused", data / "resume"
        await publish_tasks(redis, [make_task(run_id, {**rows[0], "id": "paused", "paused": str(paused),
                                                       "resume": str(resume)})])
        deadline = time.monotonic() + 60
        while not paused.exists():  # turn 1 was generated (at version 0) and the env holds the episode
            assert time.monotonic() < deadline, "the paused episode never reached its first env step"
            await asyncio.sleep(0.05)
        await StreamBus(redis).publish(WEIGHTS, weights_published(run_id, 1, models["ckpt"], models["sha"]))
        for i, row in enumerate(rows[1:]):  # until an episode of the same run is served by version 1
            await publish_tasks(redis, [make_task(run_id, {**row, "id": f"probe-{i}"})])
            probe = await result_of(redis, run_id, f"probe-{i}")
            if probe.trajectories[0].steps[0].weight_version == 1:
                break
        else:
            raise AssertionError("version 1 was never served")
        resume.touch()
        return await result_of(redis, run_id, "paused")
    finally:
        await redis.aclose()


async def result_of(redis, run_id: str, task_id: str):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        results = await collect_results(redis, run_id, expected=1, timeout_s=120)
        for r in results:
            if r.task_id == task_id:
                assert r.status == "completed", r.error
                return r
        await asyncio.sleep(0.1)
    raise TimeoutError(task_id)


def episode_logprobs(model_dir: Path, traj) -> torch.Tensor:
    """log p(token) of every response position under `model_dir`, from one forward pass over the whole
    episode, with the HF engine's sampling distribution (temperature 1, nothing barred)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(traj.prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(traj.response_ids)[:, None])[:, 0]


def test_episode_carries_both_versions_token_by_token(episode):
    result, _ = episode
    [traj] = result.trajectories
    assert len(traj.steps) == 3 and [s.weight_version for s in traj.steps] == [0, 1, 1]
    assert result.policy_versions == (0, 1)
    trained = [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m]
    assert trained == [0] * len(traj.steps[0].response_ids) + [1] * sum(len(s.response_ids) for s in traj.steps[1:])
    assert all(v == -1 for v, m in zip(traj.versions, traj.loss_mask, strict=True) if not m)


def test_only_model_tokens_are_trained_and_env_tokens_get_no_advantage(episode):
    from services.trainer.algorithm import compute_advantages
    from services.trainer.batch import GroupBuffer, build_tensors, samples_from_result
    from shared.contracts.run_config import AlgorithmConfig

    result, tokenizer = episode
    [traj] = result.trajectories
    assert not traj.mismatch
    model_tokens = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    assert model_tokens == [t for s in traj.steps for t in s.response_ids]  # every generated token, in order
    env_tokens = tokenizer.convert_ids_to_tokens([t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True)
                                                  if not m])
    words = [s.observation["word"] for s in traj.steps[:-1]]  # what the env said after turns 1 and 2
    assert [t for t in env_tokens if t not in ("<|im_start|>", "<|im_end|>", "user", "assistant")] == words
    assert env_tokens.count("user") == env_tokens.count("assistant") == 2  # a user message and a reply header
    assert env_tokens.count("<|im_start|>") == 4  # ... after each of the first two turns
    # the trainer's tensors: two copies of the episode with different rewards make one GRPO group
    buffer = GroupBuffer(2, need_greedy=False)
    for sample_idx, reward in ((0, 1.0), (1, 0.0)):
        for s in samples_from_result(result.model_copy(update={"sample_idx": sample_idx})):
            s.reward = reward
            buffer.add(s)
    [group] = buffer.complete_groups()
    t = build_tensors([group], pad_id=tokenizer.pad_token_id)
    mask = torch.tensor(traj.loss_mask)
    assert torch.equal(t["response_mask"][0, :len(mask)], mask)
    assert torch.equal(t["behaviour_log_probs"][0, :len(mask)], torch.tensor(traj.logprobs) * mask)
    advantages, _ = compute_advantages(AlgorithmConfig(adv_estimator="grpo"), t)
    assert (advantages[:, :len(mask)][:, mask == 0] == 0).all()
    assert (advantages[0, :len(mask)][mask == 1] > 0).all() and (advantages[1, :len(mask)][mask == 1] < 0).all()
    assert t["token_level_rewards"][0].nonzero().flatten().tolist() == [max(i for i, m in enumerate(mask) if m)]


def test_behaviour_logprobs_are_the_generating_versions_over_the_whole_episode(episode, models):
    result, tokenizer = episode
    [traj] = result.trajectories
    mask, versions = torch.tensor(traj.loss_mask).bool(), torch.tensor(traj.versions)
    rollout = torch.tensor(traj.logprobs)
    by_version = {v: episode_logprobs(models[f"v{v}"], traj) for v in (0, 1)}
    for v, reference in by_version.items():
        mine = mask & (versions == v)
        torch.testing.assert_close(rollout[mine], reference[mine], atol=1e-4, rtol=0)
        other = mask & (versions == 1 - v)  # the other version's weights do not explain these tokens
        assert (rollout[other] - reference[other]).abs().max() > 1e-2


def test_trainer_corrects_each_token_for_the_version_that_generated_it(episode, models):
    """The trainer at version 1 recomputes every token's logprob; the truncated IS weight of a token is
    min(pi_trainer / pi_behaviour, cap) with pi_behaviour its own version's, and the mismatch metrics count
    only the tokens version 1 generated."""
    from services.trainer.algorithm import rollout_correction
    from services.trainer.batch import GroupBuffer, build_tensors, samples_from_result
    from services.trainer.engine import PolicyEngine
    from services.trainer.learner import Learner, mismatch_metrics, same_version_diffs
    from shared.contracts.run_config import AlgorithmConfig

    result, tokenizer = episode
    [traj] = result.trajectories
    [sample] = samples_from_result(result)
    assert sample.min_version == 0  # its staleness is its oldest trained token's
    buffer = GroupBuffer(1, need_greedy=False)
    buffer.add(sample)
    t = build_tensors(buffer.complete_groups(), pad_id=tokenizer.pad_token_id)
    algo = AlgorithmConfig(adv_estimator="grpo", is_cap=2.0)
    engine = PolicyEngine(str(models["v1"]), algo, micro_batch_size=1, group_size=1)
    old, _ = engine.log_probs(t)
    n = len(traj.response_ids)
    mask, versions = torch.tensor(traj.loss_mask).bool(), torch.tensor(traj.versions)
    from transformers import AutoModelForCausalLM

    def plain_logprobs(model: Path) -> torch.Tensor:  # the trainer's logprob: the plain distribution, nothing barred
        hf = AutoModelForCausalLM.from_pretrained(model).eval()
        with torch.no_grad():
            logits = hf(torch.tensor([traj.prompt_ids + traj.response_ids])).logits[0, len(traj.prompt_ids) - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(traj.response_ids)[:, None])[:, 0]

    trainer = plain_logprobs(models["v1"])
    torch.testing.assert_close(old[0, :n][mask], trainer[mask], atol=1e-5, rtol=0)
    weights, _, metrics = rollout_correction(old, t["behaviour_log_probs"], t["response_mask"], algo)
    expected = torch.exp(trainer - torch.tensor(traj.logprobs)).clamp(max=algo.is_cap)
    torch.testing.assert_close(weights[0, :n][mask], expected[mask], atol=1e-4, rtol=1e-4)
    assert (weights[0, :n][~mask] == 0).all()
    v0, v1 = mask & (versions == 0), mask & (versions == 1)
    # another policy's tokens are re-weighted by pi_v1 / pi_v0, their behaviour logprobs version 0's own ...
    torch.testing.assert_close(torch.tensor(traj.logprobs)[v0], plain_logprobs(models["v0"])[v0], atol=1e-3, rtol=0)
    assert (weights[0, :n][v0] - 1).abs().max() > 1e-3
    # ... the same policy's only by float noise: the engine samples from the distribution the trainer computes
    assert (weights[0, :n][v1] - 1).abs().max() < 1e-3
    same = mismatch_metrics(same_version_diffs(t, old, version=1))
    assert same["logprob_diff_tokens"] == int(v1.sum())
    assert same["logprob_diff_max"] == pytest.approx(float((trainer - torch.tensor(traj.logprobs))[v1].abs().max()),
                                                     abs=1e-5)
    # a waiting sample (the trainer's probe when its batch holds no token of its version) gives the same figures
    probe = Learner(engine, algo, tokenizer.pad_token_id).probe_diffs([sample], version=1)
    torch.testing.assert_close(probe, same_version_diffs(t, old, version=1))
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(
        float((torch.exp(trainer - torch.tensor(traj.logprobs))[mask] > algo.is_cap).float().mean()), abs=1e-6)
