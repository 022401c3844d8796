"""The learning loop with sampler and trainer in one process (HF sampling, verl FSDP2 update, HF export,
in-place weight swap): a tiny random-init model learns the recall task (number word -> digit) from below
chance, every question of it, not one answer for all."""

from __future__ import annotations

import torch

from tests.support.demo import BAR, FINAL_VERSIONS, STEPS, run_inprocess
from tests.support.recall import WORDS
from tests.support.tiny_model import build_number_model


def test_tiny_model_learns_every_question_of_the_recall_task_inprocess(tmp_path):
    torch.manual_seed(0)
    out = run_inprocess(build_number_model(tmp_path / "m"), steps=STEPS, log=lambda *_: None)
    rewards, accuracy = out["reward_by_version"], out["question_accuracy"]
    assert rewards[0] <= BAR["initial_reward_max"], rewards
    assert sum(rewards[-FINAL_VERSIONS:]) / FINAL_VERSIONS >= BAR["final_reward_min"], rewards
    assert set(accuracy) == set(WORDS) and min(accuracy.values()) >= BAR["question_accuracy_min"], accuracy
