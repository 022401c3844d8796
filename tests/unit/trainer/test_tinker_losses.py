"""Tinker's losses as the trainer computes them, per token: their gradients with respect to the policy's
logprobs, which the values alone do not show (CISPO's clipped ratio takes no gradient; GSPO's ratio is its
sequence's; DRO's penalty pulls the logprob back toward the sampler's). And what an op counts as usage."""

from __future__ import annotations

import pytest
import torch

from services.trainer.tinker_models import LOSSES, loss_config

LOGP = [-1.0, -2.0, -0.5]
SAMPLER = [-2.0, -2.0, -0.2]  # ratios e, 1, e^-0.3
ADVANTAGES = [1.0, -1.0, 2.0]


def grad(name: str, config: dict, **inputs: list[float]) -> list[float]:
    logp = torch.tensor(LOGP, requires_grad=True)
    inputs = {"logprobs": torch.tensor(SAMPLER), "advantages": torch.tensor(ADVANTAGES)} | {
        k: torch.tensor(v) for k, v in inputs.items()}
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


def test_gspo_gives_every_token_its_sequence_ratio_over_the_masked_tokens_and_clips_it_whole():
    # the mask leaves out the first token, whose own ratio (e) PPO would clip: the sequence ratio is the
    # geometric mean of the other two, e^-0.15, and each token's gradient is that ratio times its advantage
    seq = torch.exp(torch.tensor(-0.15)).item()
    assert grad("gspo", {}, sequence_ratio_mask=[0, 1, 1]) == pytest.approx(
        [-seq * a for a in ADVANTAGES], abs=1e-6)
    # clipped to [0.9, 1.1], e^-0.15 (0.86) is below the floor: the negative advantage's token takes the clipped,
    # constant ratio (no gradient); the positive ones keep the sequence ratio's
    assert grad("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, sequence_ratio_mask=[0, 1, 1]) == (
        pytest.approx([-seq * 1.0, 0.0, -seq * 2.0], abs=1e-6))
    # over every token the ratio is e^((1 + 0 - 0.3) / 3) = 1.26, above the ceiling 1.2: clipped for the whole
    # sequence, so only the negative advantage's token keeps a gradient
    whole = torch.exp(torch.tensor(0.7 / 3)).item()
    assert grad("gspo", {}, sequence_ratio_mask=[1, 1, 1]) == pytest.approx([0.0, whole, 0.0], abs=1e-6)


def test_stable_reinforce_weighs_reinforce_by_the_truncated_ratio_at_the_sampled_positions_alone():
    # ratios e (2.72, above the cap 2: counts as 2), 1 and e^-0.3; the last position was not sampled (weight 0)
    ratios = torch.exp(torch.tensor(LOGP) - torch.tensor(SAMPLER)).clamp(max=2.0)
    expected = [-ratios[0].item() * 1.0, -1.0 * -1.0, 0.0]
    assert grad("stable_reinforce", {}, weights=[1, 1, 0]) == pytest.approx(expected, abs=1e-6)
    assert grad("stable_reinforce", {"truncation": 3.0}, weights=[1, 0, 0])[0] == pytest.approx(-2.718282, abs=1e-5)
    # the KL penalty's gradient, d/dlogp (e^(q - logp) + logp - q - 1) = 1 - e^(q - logp), pulls toward the sampler
    kl = grad("stable_reinforce", {"kl_coeff": 0.5}, weights=[1, 1, 0])
    assert kl[0] - expected[0] == pytest.approx(0.5 * (1 - torch.exp(torch.tensor(-1.0)).item()), abs=1e-6)
    assert kl[1] - expected[1] == pytest.approx(0.0, abs=1e-6)  # at the sampler's logprob: no pull


def test_usage_counts_input_tokens_of_forward_passes_and_one_checkpoint_per_save():
    from services.trainer.tinker_models import usage_of
    from shared.contracts.messages import TinkerOp
    from shared.contracts.messages.tinker import TinkerDatum

    def op(kind: str, *lengths: int) -> TinkerOp:
        return TinkerOp(request_id="r", owner="o", model_id="s:train:0", run_id="run", seq_id=1, op=kind,
                        data=[TinkerDatum(tokens=list(range(n)), target_tokens=list(range(n))) for n in lengths])

    assert usage_of(op("forward_backward", 3, 5)) == {"training": 8}
    assert usage_of(op("forward", 4)) == {"training": 4}
    for save in ("save_weights", "save_weights_for_sampler", "save_weights_external"):
        assert usage_of(op(save)) == {"checkpoint": 1}
    assert usage_of(op("optim_step")) == usage_of(op("load_weights")) == {}
