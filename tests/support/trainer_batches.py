"""Trainer batches shaped as RL produces them, for the tests and the benchmarks of the training step
(tests/component/test_trainer_packing.py, bench/train_step.py, tests/support/gpu_smoke.py)."""

from __future__ import annotations


def spread_batch(batch: int, prompt_len: int, max_response: int, vocab: int, *, mean_fraction: float = 0.3,
                 group_size: int = 4, seed: int = 0) -> dict:
    """A trainer batch (left-padded prompts, right-padded responses) whose response lengths are exponential
    with mean `mean_fraction * max_response`, clipped to [1, max_response], as sampled RL responses spread (most
    short, a few hitting the limit); prompt lengths uniform in [prompt_len / 2, prompt_len]."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(seed)
    responses_len = (torch.empty(batch).exponential_(1.0 / (mean_fraction * max_response), generator=g)
                     .ceil().clamp(1, max_response).long())
    prompts_len = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=g)
    prompts = torch.randint(4, vocab, (batch, prompt_len), generator=g)
    responses = torch.randint(4, vocab, (batch, max_response), generator=g)
    attention = torch.zeros(batch, prompt_len + max_response, dtype=torch.long)
    for i in range(batch):
        attention[i, prompt_len - prompts_len[i]:prompt_len + responses_len[i]] = 1
    rewards = torch.zeros(batch, max_response)
    rewards[torch.arange(batch), responses_len - 1] = torch.randint(0, 2, (batch,), generator=g).float()
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "response_mask": attention[:, prompt_len:].clone(), "token_level_rewards": rewards,
            "uid": np.array([str(i // group_size) for i in range(batch)], dtype=object)}
