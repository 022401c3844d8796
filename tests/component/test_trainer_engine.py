"""verl's FSDP2 engine on CPU through our PolicyEngine: log-probs equal plain HF, the loss verl optimizes
equals verl's policy loss called directly, and the exported HF checkpoint holds the updated weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services.trainer.algorithm import compute_advantages, rollout_correction
from shared.contracts.run_config import AlgorithmConfig
from tests.support.tiny_model import build_number_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_number_model(tmp_path_factory.mktemp("engine") / "m")


@pytest.fixture(scope="module")
def engine(model_dir):
    from services.trainer.engine import PolicyEngine

    return PolicyEngine(str(model_dir), AlgorithmConfig(lr=1e-2, adv_estimator="grpo"), micro_batch_size=4,
                        group_size=4)


def make_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, 64, (8, 4), generator=g)
    responses = torch.randint(2, 64, (8, 3), generator=g)
    attention = torch.ones(8, 7, dtype=torch.long)
    attention[0, :2] = 0  # a shorter, left-padded prompt
    attention[1, 6] = 0  # a shorter response
    mask = attention[:, 4:].clone()
    rewards = torch.zeros(8, 3)
    rewards[:, 1] = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 1])
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "response_mask": mask, "token_level_rewards": rewards,
            "uid": np.array(["a"] * 4 + ["b"] * 4, dtype=object)}


def test_engine_log_probs_equal_plain_hf(engine, model_dir):
    t = make_batch()
    ours, entropy = engine.log_probs(t)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        logits = hf(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                    position_ids=t["position_ids"]).logits[:, 3:-1]
    direct = torch.log_softmax(logits.float(), -1).gather(-1, t["responses"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ours, direct * t["response_mask"], atol=1e-5, rtol=1e-5)
    assert (entropy[t["response_mask"].bool()] > 0).all()


def test_engine_loss_is_verls_policy_loss_and_export_has_new_weights(engine, tmp_path):
    from verl.trainer.ppo import core_algos

    t = make_batch(1)
    old, _ = engine.log_probs(t)
    behaviour = old - 0.2 * t["response_mask"]
    advantages, _ = compute_advantages(engine.algo, t)
    weights, _, _ = rollout_correction(old, behaviour, t["response_mask"], engine.algo)
    direct, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old, log_prob=old, advantages=advantages, response_mask=t["response_mask"],
        loss_agg_mode="token-mean", config=engine.actor_config, rollout_is_weights=weights)
    before = {k: v.clone() for k, v in engine.actor.engine.module.state_dict().items()}
    metrics = engine.update(t, old, advantages, weights)
    assert metrics["loss"] == pytest.approx(float(direct), abs=1e-5)
    assert metrics["grad_norm"] > 0
    engine.export_hf(tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert {"config.json", "tokenizer.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(exported[name], before[name].full_tensor() if hasattr(before[name], "full_tensor")
                           else before[name])
    after, _ = engine.log_probs(t)
    assert not torch.allclose(after, old)
    # the run's weights_dtype: auto keeps the model's own (the tiny model is fp32); bf16 is what real runs serve
    assert exported[name].dtype == torch.float32
    state = engine.export_hf(tmp_path / "bf16", "bfloat16", weights=False)
    assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], exported[name].bfloat16())
    assert not (tmp_path / "bf16" / "model.safetensors").exists()  # the publisher writes it for a snapshot only
    # An export is a snapshot: the next optimizer step must not change it (the publisher diffs the next export
    # against it; an export aliasing the fp32 parameters made every delta empty while the weights moved).
    first = engine.export_hf(tmp_path / "fp32", weights=False)
    kept = {k: v.clone() for k, v in first.items()}
    engine.update(t, old, advantages, weights)
    assert all(torch.equal(first[k], kept[k]) for k in first)
    assert not torch.equal(engine.export_hf(tmp_path / "next", weights=False)[name], first[name])


def test_ppo_with_gae_critic_trains_both_and_checkpoints(model_dir, tmp_path):
    from services.trainer.batch import GroupBuffer, samples_from_result
    from services.trainer.engine import PolicyEngine
    from services.trainer.learner import Learner
    from tests.support.demo import sample_results

    algo = AlgorithmConfig(adv_estimator="gae", lr=1e-2, critic_lr=1e-2, lam=0.95)
    engine = PolicyEngine(str(model_dir), algo, micro_batch_size=8, group_size=1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    buffer = GroupBuffer(1, need_greedy=False)
    for r in sample_results(hf, tokenizer, "gae", 0, 0, 8, 1):
        for s in samples_from_result(r):
            buffer.add(s)
    learner = Learner(engine, algo, tokenizer.pad_token_id)
    metrics = learner.step(buffer.complete_groups(), 0)
    assert metrics["value_loss"] > 0 and metrics["grad_norm"] > 0
    engine.save(tmp_path / "ckpt", 1)
    assert (tmp_path / "ckpt" / "critic").is_dir()
    engine.load(tmp_path / "ckpt")


def test_kl_to_reference_policy_enters_the_loss(model_dir):
    from services.trainer.engine import PolicyEngine

    algo = AlgorithmConfig(adv_estimator="grpo", lr=5e-2, kl_coef=0.5, kl_penalty="low_var_kl")
    engine = PolicyEngine(str(model_dir), algo, micro_batch_size=4, group_size=4)
    assert engine.ref is not None
    t = make_batch(2)
    old, _ = engine.log_probs(t)
    advantages, _ = compute_advantages(algo, t)
    weights = torch.ones_like(old)
    first = engine.update(t, old, advantages, weights, engine.log_probs(t, reference=True)[0])
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step
    ref, _ = engine.log_probs(t, reference=True)
    torch.testing.assert_close(ref, old)  # the reference stays frozen
    second = engine.update(t, old, advantages, weights, ref)
    assert second["kl_loss"] > 0
