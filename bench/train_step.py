"""Training-step throughput, padded vs packed: `python -m bench.train --parts step` (part of `make bench-train`).

One verl policy update (PPO loss, AdamW) on a batch whose response lengths spread as RL rollouts do (mean
response ~30% of the maximum, prompts of varied length), on the same model and batch, two ways:
- padded: today's path before packing, every micro-batch padded to its longest sequence (`micro_batch_size`
  rows a micro-batch);
- packed: verl's padding removal (sequences end to end, attention per sequence) and token-budget
  micro-batches (`micro_batch_tokens`).
tokens/s counts real tokens only (prompt + response, no padding), so both figures are work a user asked for.
The batch is tests/support/trainer_batches.py's `spread_batch`, also the GPU smoke's RL-shaped batch.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from tests.support.trainer_batches import spread_batch


def update_fn(engine, t: dict, seed: int = 0):
    """A closure running one verl policy update of `engine` on batch `t` (GRPO advantages of its rewards)."""
    import torch

    from services.trainer.algorithm import compute_advantages

    old, _ = engine.log_probs(t)
    advantages, _ = compute_advantages(engine.algo, t)
    behaviour = old - 0.05 * torch.rand(old.shape, generator=torch.Generator().manual_seed(seed)) * t["response_mask"]
    weights = torch.ones_like(old)
    return lambda: engine.update(t, behaviour, advantages, weights)


def bench_step(work: Path, iters: int = 5, *, hidden: int = 512, intermediate: int = 1536, layers: int = 2,
               batch: int = 32, prompt_len: int = 64, max_response: int = 448, micro_batch_tokens: int = 2048) -> dict:
    """A model whose width, not its attention over the sequence, sets the cost per token (as in real models:
    Qwen2.5-0.5B is 896 wide, its MLP 4864), on the tests' 512-token vocabulary."""
    from bench.train import timed_pair
    from services.trainer.engine import PolicyEngine
    from shared.contracts.run_config import AlgorithmConfig
    from tests.support.tiny_model import build_tiny_model

    model_dir = build_tiny_model(work / "step-model", hidden_size=hidden, num_layers=layers,
                                 intermediate_size=intermediate)
    t = spread_batch(batch, prompt_len, max_response, vocab=500)
    algo = AlgorithmConfig(lr=1e-5, adv_estimator="grpo")
    fused = {"fused_backend": "torch"}  # the trainer service's log-prob kernel, for both
    padded = PolicyEngine(str(model_dir), algo, micro_batch_size=batch, group_size=4, **fused)
    packed = PolicyEngine(str(model_dir), algo, micro_batch_size=batch, group_size=4, remove_padding=True,
                          micro_batch_tokens=micro_batch_tokens, **fused)
    padded_step, packed_step = update_fn(padded, t), update_fn(packed, t)
    first_padded, first_packed = padded_step(), packed_step()  # warm-up; the same update, so the same loss
    padded_times, packed_times = timed_pair(padded_step, packed_step, iters)
    tokens = int(t["attention_mask"].sum())
    responses = t["response_mask"].sum(-1).float()
    p, q = statistics.median(padded_times), statistics.median(packed_times)
    return {
        "step_tokens_per_s_padded": tokens / p, "step_tokens_per_s_packed": tokens / q,
        "step_packed_speedup": p / q, "step_padded_s": p, "step_packed_s": q,
        "step_loss_padded": first_padded["loss"], "step_loss_packed": first_packed["loss"],
        "step_batch": (f"{batch} sequences, prompts <= {prompt_len}, responses <= {max_response} (mean "
                       f"{responses.mean() / max_response:.0%} of the maximum), {tokens} real tokens of "
                       f"{t['input_ids'].numel()} padded; {padded.num_parameters / 1e6:.1f}M params, fp32, CPU; "
                       f"packed: micro_batch_tokens {micro_batch_tokens}"),
        "step_loadavg_1m": os.getloadavg()[0], "step_measured_at": time.strftime("%Y-%m-%d %H:%M"),
    }
