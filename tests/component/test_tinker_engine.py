"""Tinker's split step on the trainer's shared-base LoRA engine, in process (verl on CPU): gradients that one
model accumulated are its own across swaps (another model's step neither applies nor drops them), and the
losses' outputs agree with the loss verl backpropagated.

    pytest -q tests/component/test_tinker_engine.py
"""

from __future__ import annotations

import pytest
import torch

from services.trainer.lora_shared_engine import close_engine, engines_held, open_engine
from services.trainer.tinker_models import outputs, tensors, verl_loss
from shared.contracts.messages import TinkerDatum, TinkerOp
from shared.contracts.tinker_run import TinkerRunConfig
from tests.support.tiny_model import build_tiny_model

SEQS = [[5, 9, 13, 17, 21, 25, 29], [40, 44, 48, 52, 56, 60, 64]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tinker-engine") / "tiny")


def op(loss: str, seqs: list[list[int]], **inputs) -> TinkerOp:
    data = [TinkerDatum(tokens=s[:-1], target_tokens=s[1:], **{k: v[i] for k, v in inputs.items()})
            for i, s in enumerate(seqs)]
    return TinkerOp(request_id="f", owner="o", model_id="m", run_id="r", seq_id=1, op="forward_backward",
                    loss_fn=loss, data=data)


def step(engine, o: TinkerOp, lr: float = 1e-2) -> list[dict]:
    t, extra = tensors(o, 0)
    logp, loss = engine.forward_backward(t, verl_loss(o.loss_fn, o.loss_fn_config), extra)
    out = outputs(o, t, extra, logp)
    assert loss == pytest.approx(sum(sum(d["elementwise_loss"]) for d in out), rel=1e-4)
    return out


def probe(engine) -> torch.Tensor:
    t, _ = tensors(op("cross_entropy", SEQS), 0)
    return engine.log_probs(t)[0]


def test_each_models_gradients_stay_its_own_across_swaps(model_dir):
    config = TinkerRunConfig(name="t", model_id="m", session_id="s", owner="o", owner_name="n", base_model="tiny",
                             model=str(model_dir), lora={"rank": 4})
    engines = {name: open_engine(name, str(model_dir), config.algorithm(), seed=0, device="cpu")
               for name in ("a", "b", "solo")}
    try:
        assert engines_held() == 1  # one base for the three
        mine, theirs = op("cross_entropy", SEQS[:1]), op("cross_entropy", SEQS[1:], weights=[[2.0] * 6])
        step(engines["a"], mine)  # a's gradients wait while b steps
        step(engines["b"], theirs)
        engines["b"].optim_step(1e-2, (0.9, 0.95), 1e-8, 0.0, 0.0)
        engines["a"].optim_step(1e-2, (0.9, 0.95), 1e-8, 0.0, 0.0)
        step(engines["solo"], mine)  # the same step with nobody in between
        engines["solo"].optim_step(1e-2, (0.9, 0.95), 1e-8, 0.0, 0.0)
        a, solo, b = probe(engines["a"]), probe(engines["solo"]), probe(engines["b"])
        assert torch.allclose(a, solo, atol=1e-6)
        assert not torch.allclose(a, b, atol=1e-4)  # b trained on something else
    finally:
        for name in engines:
            close_engine(name)


def test_rl_loss_outputs(model_dir):
    config = TinkerRunConfig(name="t", model_id="m", session_id="s", owner="o", owner_name="n", base_model="tiny",
                             model=str(model_dir), lora={"rank": 4, "train_mlp": False})
    engine = open_engine("is", str(model_dir), config.algorithm(), seed=0, device="cpu")
    try:
        current = probe(engine)[:, :6].tolist()
        adv = [[1.0] * 6, [-1.0] * 6]
        out = step(engine, op("importance_sampling", SEQS, logprobs=current, advantages=adv))
        # on-policy: the ratio is 1, so each token's loss is -advantage
        assert out[0]["elementwise_loss"] == pytest.approx([-1.0] * 6, abs=1e-5)
        assert out[1]["elementwise_loss"] == pytest.approx([1.0] * 6, abs=1e-5)
        stale = [[lp - 1.0 for lp in row] for row in current]  # the sampler was e times less likely: ratio e
        out = step(engine, op("ppo", SEQS, logprobs=stale, advantages=adv))
        assert out[0]["elementwise_loss"] == pytest.approx([-1.2] * 6, abs=1e-4)  # clipped at 1.2
        assert out[1]["elementwise_loss"] == pytest.approx([torch.e] * 6, abs=1e-4)  # min(r*A, clip(r)*A) = r*A
        now = probe(engine)[:, :6]  # ppo stepped nothing yet (no optim_step): still `current`
        out = step(engine, op("cispo", SEQS, logprobs=stale, advantages=adv))
        expected = (-1.2 * now * torch.tensor(adv)).tolist()  # -sg(clip(ratio e)) * logprob * advantage
        assert out[0]["elementwise_loss"] == pytest.approx(expected[0], abs=1e-4)
        assert out[1]["elementwise_loss"] == pytest.approx(expected[1], abs=1e-4)
        dro = op("dro", SEQS, logprobs=stale, advantages=adv)
        dro.loss_fn_config = {"beta": 0.5}
        out = step(engine, dro)  # -(logprob * advantage - beta/2 * (log ratio 1)^2)
        expected = (-(now * torch.tensor(adv) - 0.25)).tolist()
        assert out[0]["elementwise_loss"] == pytest.approx(expected[0], abs=1e-4)
        assert out[1]["elementwise_loss"] == pytest.approx(expected[1], abs=1e-4)
        # gspo: the sampler is stale (ratio e) on the first three tokens only, and the mask covers the last three:
        # every token's ratio is the sequence's, 1, where ppo clipped the first three at 1.2
        half = [[lp - 1.0 if j < 3 else lp for j, lp in enumerate(row)] for row in now.tolist()]
        mask = [[0.0] * 3 + [1.0] * 3] * 2
        out = step(engine, op("gspo", SEQS, logprobs=half, advantages=adv, sequence_ratio_mask=mask))
        assert out[0]["elementwise_loss"] == pytest.approx([-1.0] * 6, abs=1e-4)
        assert out[1]["elementwise_loss"] == pytest.approx([1.0] * 6, abs=1e-4)
        # without a mask the ratio covers the tokens with a nonzero advantage: here the first three, ratio e
        out = step(engine, op("gspo", SEQS, logprobs=half, advantages=[[a] * 3 + [0.0] * 3 for a in (1.0, -1.0)]))
        assert out[0]["elementwise_loss"] == pytest.approx([-1.2] * 3 + [0.0] * 3, abs=1e-4)  # clipped at 1.2
        assert out[1]["elementwise_loss"] == pytest.approx([torch.e] * 3 + [0.0] * 3, abs=1e-4)
    finally:
        close_engine("is")
