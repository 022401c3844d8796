"""One training step on a batch of groups: verl log-probs, advantages, truncated IS weights, PPO update.

Pure compute: the service loop (loop.py) decides what goes in and makes the result durable."""

from __future__ import annotations

import time
from collections import Counter

import torch

from services.trainer.algorithm import compute_advantages, importance_weights
from services.trainer.batch import Group, build_tensors, staleness
from services.trainer.engine import PolicyEngine
from shared.run_config import AlgorithmConfig


class Learner:
    def __init__(self, engine: PolicyEngine, algo: AlgorithmConfig, pad_id: int):
        self.engine, self.algo, self.pad_id = engine, algo, pad_id

    def step(self, groups: list[Group], version: int, seed: int = 0) -> dict[str, float]:
        """Train on `groups` (weights at `version`); returns the step's metrics (verl's plus ours)."""
        started = time.perf_counter()
        t = build_tensors(groups, self.pad_id)
        old, entropy = self.engine.log_probs(t)
        ref = self.engine.log_probs(t, reference=True)[0] if self.engine.ref is not None else None
        values = self.engine.values(t) if self.engine.critic is not None else None
        advantages, returns = compute_advantages(self.algo, t, values)
        weights, is_metrics = importance_weights(old, t["behaviour_log_probs"], t["response_mask"],
                                                 self.algo.is_cap, t["sample_weights"])
        metrics = self.batch_metrics(groups, t, old, entropy, version)
        if t["response_mask"].sum() > 0:  # a batch of only masked (errored) samples has nothing to learn
            verl_metrics = self.engine.update(t, old, advantages, weights, ref, seed=seed)
            metrics |= {
                "grad_norm": verl_metrics.get("grad_norm", 0.0), "loss": verl_metrics.get("loss", 0.0),
                "clip_fraction": verl_metrics.get("actor/pg_clipfrac", 0.0),
                "ppo_kl": verl_metrics.get("actor/ppo_kl", 0.0), "kl_ref": verl_metrics.get("kl_loss", 0.0),
            }
        if values is not None:
            critic = self.engine.update_critic(t, values, returns)
            metrics |= {"value_loss": critic.get("critic/vf_loss", 0.0),
                        "value_mean": float((values * t["response_mask"]).sum() / t["response_mask"].sum().clamp(min=1))}
        metrics["is_weight_mean"] = float(is_metrics.get("rollout_is_mean", 1.0))
        elapsed = time.perf_counter() - started
        metrics["step_s"] = elapsed
        metrics["tokens_per_s"] = float(t["attention_mask"].sum()) / elapsed
        return metrics

    @staticmethod
    def batch_metrics(groups: list[Group], t: dict, old: torch.Tensor, entropy: torch.Tensor,
                      version: int) -> dict[str, float]:
        samples = [s for g in groups for s in g.samples.values()]
        rewards = torch.tensor([s.reward for s in samples])
        mask = t["response_mask"].float()
        tokens = mask.sum().clamp(min=1)
        ages = Counter(staleness(samples, version))
        return {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "pass_rate": float((rewards > 0).float().mean()),
            # k1 estimate of KL(behaviour || current) on the sampled tokens
            "kl_behaviour": float(((t["behaviour_log_probs"] - old) * mask).sum() / tokens),
            "entropy": float((entropy * mask).sum() / tokens),
            "num_samples": float(len(samples)), "num_groups": float(len(groups)),
            "response_tokens": float(mask.sum()),
            **{f"staleness_{age}": float(n) for age, n in sorted(ages.items())},
        }
