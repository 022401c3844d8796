"""One training step on a batch of groups: verl log-probs, advantages, truncated IS weights, PPO update.

Pure compute: the service loop (loop.py) decides what goes in and makes the result durable."""

from __future__ import annotations

import time
from collections import Counter

import torch

from services.trainer.algorithm import compute_advantages, rollout_correction, share_sequence_advantages
from services.trainer.batch import Group, Sample, build_tensors, staleness
from services.trainer.engine import PolicyEngine
from shared.contracts.run_config import AlgorithmConfig


class Learner:
    def __init__(self, engine: PolicyEngine, algo: AlgorithmConfig, pad_id: int):
        self.engine, self.algo, self.pad_id = engine, algo, pad_id

    def step(self, groups: list[Group], version: int, seed: int = 0, probe: list[Sample] = ()) -> dict[str, float]:
        """Train on `groups` (weights at `version`); returns the step's metrics (verl's plus ours). `probe`:
        waiting samples (not trained on here) with tokens `version` generated, on which the training-inference
        mismatch is measured too."""
        started = time.perf_counter()
        t = build_tensors(groups, self.pad_id)
        old, entropy = self.engine.log_probs(t)
        ref = self.engine.log_probs(t, reference=True)[0] if self.engine.has_reference else None
        values = self.engine.values(t) if self.engine.critic is not None else None
        advantages, returns = compute_advantages(self.algo, t, values)
        advantages = share_sequence_advantages(advantages, t)
        weights, t["response_mask"], corr_metrics = rollout_correction(
            old, t["behaviour_log_probs"], t["response_mask"], self.algo, t["sample_weights"])
        metrics = self.batch_metrics(groups, t, old, entropy, version)
        metrics["groups_without_signal"] = groups_without_signal(groups, advantages, t["response_mask"])
        metrics |= mismatch_metrics(torch.cat([same_version_diffs(t, old, version), self.probe_diffs(probe, version)]))
        metrics |= {k: float(v) for k, v in corr_metrics.items()}  # verl's names: rollout_corr/...
        metrics["is_truncated_fraction"] = metrics.get("rollout_corr/rollout_is_ratio_fraction_high", 0.0)
        if t["response_mask"].sum() > 0:  # a batch of only masked (errored) samples has nothing to learn
            verl_metrics = self.engine.update(t, old, advantages, weights, ref, seed=seed)
            metrics |= {
                "grad_norm": verl_metrics.get("grad_norm", 0.0), "loss": verl_metrics.get("loss", 0.0),
                "clip_fraction": verl_metrics.get("actor/pg_clipfrac", 0.0),
                "ppo_kl": verl_metrics.get("actor/ppo_kl", 0.0), "kl_ref": verl_metrics.get("kl_loss", 0.0),
                "mfu": verl_metrics.get("mfu", 0.0),  # verl's FLOPs estimate over the device's peak (0 on CPU)
            }
        if values is not None:
            critic = self.engine.update_critic(t, values, returns)
            metrics |= {"value_loss": critic.get("critic/vf_loss", 0.0),
                        "value_mean": float((values * t["response_mask"]).sum() / t["response_mask"].sum().clamp(min=1))}
        metrics["is_weight_mean"] = metrics.get("rollout_corr/rollout_is_mean", 1.0)
        elapsed = time.perf_counter() - started
        metrics["step_s"] = elapsed
        metrics["tokens_per_s"] = float(t["attention_mask"].sum()) / elapsed
        return metrics

    def probe_diffs(self, probe: list[Sample], version: int) -> torch.Tensor:
        from services.trainer.ranks import world_size

        probe = list(probe)[: len(probe) - len(probe) % world_size()]  # rows split evenly over trainer ranks
        if not probe:
            return torch.zeros(0)
        t = build_tensors([Group(("mismatch-probe", -1), {(i, 0): s for i, s in enumerate(probe)})], self.pad_id)
        return same_version_diffs(t, self.engine.log_probs(t)[0], version)

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
            **async_metrics(samples, version),
        }


def async_metrics(samples: list[Sample], version: int) -> dict[str, float]:
    """verl's fully-async counters for one step's batch, under verl's names: samples generated before the
    trained-from version, and partial rollouts (samples whose trained tokens span policy versions: a generation
    that continued on new weights) with the largest span."""
    spans = [max(vs) - min(vs) for s in samples if (vs := [v for v in s.versions if v >= 0])]
    partial = sum(span > 0 for span in spans)
    return {
        "fully_async/count/stale_samples_processed": float(sum(age > 0 for age in staleness(samples, version))),
        "fully_async/partial/total_partial_num": float(partial),
        "fully_async/partial/partial_ratio": partial / max(len(spans), 1),
        "fully_async/partial/max_partial_span": float(max(spans, default=0)),
    }


def rollout_idle_ratio(spans: list[tuple[str, float, float]], start: float, end: float) -> float | None:
    """verl's `fully_async/rollouter/idle_ratio`, read off the results that reached this trainer: for each rollout
    worker that delivered episodes (worker, started_at, finished_at) in [start, end], the share of that window in
    which it had none in flight, averaged over those workers; None when none delivered. Episodes still in flight
    at `end` are not seen yet, so on a long-tailed workload this overstates idleness by up to one episode."""
    window = end - start
    if window <= 0 or not spans:
        return None
    busy: dict[str, float] = {}
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for worker, a, b in spans:
        by_worker.setdefault(worker, []).append((max(a, start), min(b, end)))
    for worker, intervals in by_worker.items():
        covered, reach = 0.0, start
        for a, b in sorted(intervals):
            if b > reach:
                covered += b - max(a, reach)
                reach = b
        busy[worker] = covered / window
    return 1.0 - sum(busy.values()) / len(busy)


def groups_without_signal(groups: list[Group], advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of groups none of whose trained tokens got a nonzero advantage: they teach the policy nothing.
    Read off the estimator's own advantages, so it holds for each: GRPO/RLOO groups of equal rewards, ReMax
    rewards equal to the greedy baseline's, while GAE's critic or REINFORCE++'s batch whitening give such groups
    a signal. The controller warns when a run's every group is like that for versions in a row."""
    per_row = (advantages.abs() * mask).amax(dim=1) if advantages.numel() else torch.zeros(len(mask))
    per_group = torch.split(per_row, [len(g.samples) for g in groups])  # build_tensors' row order
    return sum(float(rows.max()) < 1e-6 for rows in per_group) / max(len(groups), 1)


def same_version_diffs(t: dict, old: torch.Tensor, version: int) -> torch.Tensor:
    """|rollout engine's logprob - trainer's recomputed logprob| of the trained tokens that the weights of
    `version` generated. The trainer holds exactly those weights, so any difference is the engines', not the
    policy's: kernels, dtype, published weights' precision, the sampler's processing."""
    same = t["response_mask"].bool() & (t["behaviour_versions"] == version)
    return (old - t["behaviour_log_probs"]).abs()[same]


def mismatch_metrics(diffs: torch.Tensor) -> dict[str, float]:
    """Training-inference mismatch of a step: mean, max and number of `same_version_diffs`; nothing when no
    token of the trained-from version was at hand (every token came from older versions)."""
    if diffs.numel() == 0:
        return {}
    return {"logprob_diff_mean": float(diffs.mean()), "logprob_diff_max": float(diffs.max()),
            "logprob_diff_tokens": float(diffs.numel())}
