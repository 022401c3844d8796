"""The RL math, all of it verl's (verl.trainer.ppo.core_algos and its rollout-correction helper): advantage
estimators by name, truncated importance weights, and the actor config verl's PPO loss reads."""

from __future__ import annotations

import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
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


def verl_algo_config(algo: AlgorithmConfig) -> AlgoConfig:
    return AlgoConfig(gamma=algo.gamma, lam=algo.lam, adv_estimator=algo.adv_estimator,
                      norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, kl_penalty=algo.kl_penalty)


def importance_weights(old_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       cap: float, sample_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Truncated IS weights min(pi_old / pi_behaviour, cap) per token (verl's TIS), times per-sample weights
    (stale samples kept under `stale_policy="downweight"`)."""
    weights, metrics = compute_rollout_correction_weights(
        log_ratio=old_log_probs - behaviour_log_probs, response_mask=response_mask.float(), rollout_is="token",
        rollout_is_threshold=cap)
    if sample_weights is not None:
        weights = weights * sample_weights.unsqueeze(-1)
    return weights.detach(), metrics


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
