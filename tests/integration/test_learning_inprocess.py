"""The learning loop with sampler and trainer in one process (HF sampling, verl FSDP2 update, HF export,
in-place weight swap): a tiny random-init model learns the digit task from near chance."""

from __future__ import annotations

import torch

from bench.demo import build_tiny_model, run_inprocess


def test_tiny_model_learns_digit_task_inprocess(tmp_path):
    torch.manual_seed(0)
    rewards = run_inprocess(build_tiny_model(tmp_path / "m"), steps=14, lr=5e-3, log=lambda *_: None)
    assert rewards[0] <= 0.35
    assert sum(rewards[-3:]) / 3 >= 0.7, rewards
