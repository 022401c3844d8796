"""The RL math, all of it verl's (verl.trainer.ppo.core_algos and its rollout-correction helper): advantage
estimators by name, rollout correction (truncated IS weights, rejection sampling, off-policy metrics), and the
actor config verl's PPO loss reads."""

from __future__ import annotations

import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, PolicyLossConfig

from shared.contracts.run_config import AlgorithmConfig


def compute_advantages(algo: AlgorithmConfig, t: dict, values: torch.Tensor | None = None):
    """(advantages, returns) from verl's estimator named `algo.adv_estimator`, called as verl's trainer does."""
    if algo.adv_estimator == "gae":
        if values is None:
            raise ValueError("adv_estimator 'gae' needs critic values")
        return core_algos.compute_gae_advantage_return(
            token_level_rewards=t["token_level_rewards"], values=values, response_mask=t["response_mask"],
            gamma=algo.gamma, lam=algo.lam)
    if algo.adv_estimator == "grpo":
        return core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=t["token_level_rewards"], response_mask=t["response_mask"], index=t["uid"],
            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)
    kwargs = dict(token_level_rewards=t["token_level_rewards"], response_mask=t["response_mask"], index=t["uid"],
                  config=verl_algo_config(algo))
    if algo.adv_estimator == "remax":
        kwargs["reward_baselines"] = t["reward_baselines"]
    return core_algos.get_adv_estimator_fn(algo.adv_estimator)(**kwargs)


def share_sequence_advantages(advantages: torch.Tensor, t: dict) -> torch.Tensor:
    """Each earlier sequence of a trajectory cut at its context rewrites takes the advantage of the trajectory's
    last sequence (`t["advantage_from"]`, the row of that sequence; -1: none): its mean over that row's trained
    tokens, on each of its own. Outcome estimators (GRPO, RLOO, ReMax) give a row one value: the same advantage
    the uncut trajectory would have had."""
    src = t["advantage_from"]
    rows = (src >= 0).nonzero().flatten()
    if rows.numel() == 0:
        return advantages
    mask = t["response_mask"].to(advantages.dtype)
    per_row = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    out = advantages.clone()
    out[rows] = per_row[src[rows]].unsqueeze(-1) * mask[rows]
    return out


def verl_algo_config(algo: AlgorithmConfig) -> AlgoConfig:
    return AlgoConfig(gamma=algo.gamma, lam=algo.lam, adv_estimator=algo.adv_estimator,
                      norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, kl_penalty=algo.kl_penalty)


def rollout_correction(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor,
                       response_mask: torch.Tensor, algo: AlgorithmConfig,
                       sample_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """verl's rollout correction, as verl's trainer calls it: truncated IS weights min(pi_old / pi_behaviour,
    is_cap) per token (TIS), times per-sample weights (stale samples kept under `stale_policy="downweight"`);
    the response mask with verl's rejection sampling applied (`rollout_rs`); and verl's metrics under verl's
    names (`rollout_corr/rollout_is_mean`, `.../kl`, `.../k3_kl`, `.../chi2_token`, ...)."""
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_probs, rollout_log_prob=behaviour_log_probs, response_mask=response_mask.float(),
        rollout_is="token", rollout_is_threshold=algo.is_cap, rollout_rs=algo.rollout_rs,
        rollout_rs_threshold=algo.rollout_rs_threshold)
    weights = weights.batch["rollout_is_weights"]
    if sample_weights is not None:
        weights = weights * sample_weights.unsqueeze(-1)
    if algo.rollout_rs is None:  # verl reports it only with rejection on: nothing was masked
        metrics["rollout_corr/rollout_rs_masked_fraction"] = 0.0
    return weights.detach(), mask.to(response_mask.dtype), metrics


def actor_config(algo: AlgorithmConfig, engine: FSDPEngineConfig, optim: FSDPOptimizerConfig, *, batch_size: int,
                 micro_batch_size: int, group_size: int) -> FSDPActorConfig:
    """The config verl's `ppo_loss` and policy losses read (clip ranges, loss mode, aggregation, KL, entropy)."""
    return FSDPActorConfig(
        strategy=engine.strategy, rollout_n=group_size, ppo_mini_batch_size=batch_size,
        ppo_micro_batch_size_per_gpu=micro_batch_size, ppo_epochs=algo.ppo_epochs, use_torch_compile=False,
        clip_ratio=algo.clip_ratio_high, clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
        clip_ratio_c=algo.clip_ratio_c, loss_agg_mode=algo.loss_agg_mode, entropy_coeff=algo.entropy_coeff,
        calculate_entropy=True, use_kl_loss=algo.kl_coef > 0, kl_loss_coef=algo.kl_coef,
        kl_loss_type=algo.kl_penalty, policy_loss=PolicyLossConfig(loss_mode=algo.policy_loss),
        fsdp_config=engine, optim=optim, grad_clip=algo.grad_clip,
    )
