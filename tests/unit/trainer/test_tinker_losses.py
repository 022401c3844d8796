"""Tinker's losses as the trainer computes them, per token: their gradients with respect to the policy's
logprobs, which the values alone do not show (CISPO's clipped ratio takes no gradient; DRO's penalty pulls the
logprob back toward the sampler's)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.tinker_models import LOSSES, loss_config

LOGP = [-1.0, -2.0, -0.5]
SAMPLER = [-2.0, -2.0, -0.2]  # ratios e, 1, e^-0.3
ADVANTAGES = [1.0, -1.0, 2.0]


def grad(name: str, config: dict) -> list[float]:
    logp = torch.tensor(LOGP, requires_grad=True)
    inputs = {"logprobs": torch.tensor(SAMPLER), "advantages": torch.tensor(ADVANTAGES)}
    LOSSES[name](logp, inputs, loss_config(name, config)).sum().backward()
    return logp.grad.tolist()


def test_cispo_weighs_the_policy_gradient_by_the_clipped_ratio_alone():
    ratios = torch.exp(torch.tensor(LOGP) - torch.tensor(SAMPLER)).clamp(0.8, 1.2)
    assert grad("cispo", {}) == pytest.approx((-ratios * torch.tensor(ADVANTAGES)).tolist(), abs=1e-6)
    tighter = torch.exp(torch.tensor(LOGP) - torch.tensor(SAMPLER)).clamp(0.9, 1.1)
    assert grad("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}) == pytest.approx(
        (-tighter * torch.tensor(ADVANTAGES)).tolist(), abs=1e-6)


def test_dro_pulls_the_logprob_back_toward_the_samplers_in_proportion_to_beta():
    beta = 0.5
    expected = [-a + beta * (lp - q) for lp, q, a in zip(LOGP, SAMPLER, ADVANTAGES, strict=True)]
    assert grad("dro", {"beta": beta}) == pytest.approx(expected, abs=1e-6)
