"""Our calls into verl give exactly what calling verl directly on the same batch gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig

from services.trainer.algorithm import actor_config, compute_advantages, rollout_correction, verl_algo_config
from shared.contracts.run_config import AlgorithmConfig


def batch(seed=0, groups=3, n=4, length=5) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = groups * n
    mask = (torch.rand(rows, length, generator=g) > 0.2).long()
    mask[:, 0] = 1
    rewards = torch.zeros(rows, length)
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
    rewards[torch.arange(rows), last] = torch.randint(0, 2, (rows,), generator=g).float()
    return {"token_level_rewards": rewards, "response_mask": mask,
            "uid": np.array([f"g{i // n}" for i in range(rows)], dtype=object),
            "reward_baselines": torch.rand(rows, generator=g)}


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                                  "opo", "gpg"])
def test_advantage_estimators_equal_verl(name):
    algo = AlgorithmConfig(adv_estimator=name)
    t = batch()
    ours, _ = compute_advantages(algo, t)
    kwargs = dict(token_level_rewards=t["token_level_rewards"], response_mask=t["response_mask"],
                  config=verl_algo_config(algo))
    if name == "remax":
        kwargs["reward_baselines"] = t["reward_baselines"]
    else:
        kwargs["index"] = t["uid"]
    direct, _ = core_algos.get_adv_estimator_fn(name)(**kwargs)
    torch.testing.assert_close(ours, direct)
    assert ours.abs().sum() > 0


def test_gae_equals_verl_and_needs_values():
    algo = AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8)
    t = batch()
    values = torch.randn(t["response_mask"].shape)
    ours, returns = compute_advantages(algo, t, values=values)
    direct, direct_returns = core_algos.compute_gae_advantage_return(
        t["token_level_rewards"], values, t["response_mask"], gamma=0.9, lam=0.8)
    torch.testing.assert_close(ours, direct)
    torch.testing.assert_close(returns, direct_returns)
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(algo, t)


def test_truncated_is_weights_cap_the_ratio_and_mask_padding():
    mask = torch.tensor([[1, 1, 1, 0]])
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.3]]))
    current = torch.log(torch.tensor([[0.5, 0.4, 0.2, 0.9]]))  # ratios 1, 4, 0.5, (3, padding)
    weights, kept, _ = rollout_correction(current, behaviour, mask, AlgorithmConfig(is_cap=2.0))
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 0.5, 0.0]]))
    assert kept.tolist() == mask.tolist()  # no rejection sampling unless the run asks for it
    scaled, _, _ = rollout_correction(current, behaviour, mask, AlgorithmConfig(is_cap=2.0),
                                     sample_weights=torch.tensor([0.5]))
    torch.testing.assert_close(scaled, torch.tensor([[0.5, 1.0, 0.25, 0.0]]))


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "cispo", "clip_cov", "kl_cov"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_policy_loss_equals_calling_verl_directly(loss_mode, agg):
    algo = AlgorithmConfig(policy_loss=loss_mode, loss_agg_mode=agg, clip_ratio_low=0.1, clip_ratio_high=0.3)
    cfg = actor_config(algo, FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False),
                       FSDPOptimizerConfig(lr=1e-3), batch_size=8, micro_batch_size=8, group_size=4)
    g = torch.Generator().manual_seed(1)
    old, new = -torch.rand(8, 6, generator=g), -torch.rand(8, 6, generator=g)
    adv, mask = torch.randn(8, 6, generator=g), torch.ones(8, 6)
    weights, _, _ = rollout_correction(old, old - 0.1, mask, AlgorithmConfig(is_cap=2.0))
    fn = core_algos.get_policy_loss_fn(loss_mode)
    ours = fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=cfg,
              rollout_is_weights=weights)[0]
    assert cfg.policy_loss.loss_mode == loss_mode and cfg.loss_agg_mode == agg
    assert cfg.clip_ratio_low == 0.1 and cfg.clip_ratio_high == 0.3
    direct = fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode=agg, config=cfg,
                rollout_is_weights=torch.exp(torch.tensor(0.1)).clamp(max=2.0) * mask)[0]
    torch.testing.assert_close(ours, direct)


def test_kl_penalty_and_agg_loss_are_verls():
    g = torch.Generator().manual_seed(2)
    logp, ref = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    kl = core_algos.kl_penalty(logp, ref, kl_penalty="low_var_kl")
    manual = (torch.exp(ref - logp) - (ref - logp) - 1).clamp(-10, 10)
    torch.testing.assert_close(kl, manual)
    assert core_algos.agg_loss(kl, torch.ones(4, 5), "token-mean") == pytest.approx(float(kl.mean()), rel=1e-5)


def test_rollout_correction_reports_verls_metric_set_and_applies_rejection_sampling():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=g)
    behaviour = old.clone()
    behaviour[0] -= 3.0  # row 0's tokens: ratio e^3, far out of bounds
    mask = torch.ones(4, 6)
    _, kept, metrics = rollout_correction(old, behaviour, mask, AlgorithmConfig(is_cap=2.0))
    wanted = {"rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max", "rollout_is_eff_sample_size",
              "kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_abs_diff", "rollout_rs_masked_fraction"}
    assert {f"rollout_corr/{k}" for k in wanted} <= set(metrics)
    assert kept.tolist() == mask.tolist() and metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert metrics["rollout_corr/kl"] == pytest.approx(float((behaviour - old).mean()), abs=1e-6)
    algo = AlgorithmConfig(is_cap=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    _, kept, metrics = rollout_correction(old, behaviour, mask, algo)
    assert kept[0].sum() == 0 and kept[1:].sum() == 18  # the out-of-bounds row is rejected, nothing else
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.25)


def test_rollout_rs_names_are_verls_and_a_bad_one_is_refused_with_the_choices():
    from pydantic import ValidationError
    from verl.trainer.ppo.rollout_corr_helper import SUPPORTED_ROLLOUT_RS_OPTIONS

    from shared.contracts.run_config import ROLLOUT_RS_OPTIONS

    assert set(ROLLOUT_RS_OPTIONS) == SUPPORTED_ROLLOUT_RS_OPTIONS
    with pytest.raises(ValidationError, match="unknown rollout_rs 'token_k9'.*token_k1"):
        AlgorithmConfig(rollout_rs="token_k9", rollout_rs_threshold=2.0)
    with pytest.raises(ValidationError, match="rollout_rs needs rollout_rs_threshold"):
        AlgorithmConfig(rollout_rs="token_k1")
