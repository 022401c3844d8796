"""Padding removal + token-budget micro-batches (services/trainer/engine.py: `remove_padding`,
`micro_batch_tokens`) are the same training step as the padded path: on one RL-shaped batch (spread lengths,
left-padded prompts, right-padded responses) both give the same log-probs, loss and gradient norm, for every
policy loss the run config offers and for the critic.

The covariance losses (clip_cov, kl_cov) pick the tokens they clip or penalize by a quantile over the tokens of
one micro-batch (verl computes them per micro-batch), so their loss depends on which sequences share a
micro-batch: for them the test compares one micro-batch each way, which isolates padding removal."""

from __future__ import annotations

import pytest
import torch

from services.trainer.algorithm import compute_advantages
from shared.contracts.run_config import POLICY_LOSSES, AlgorithmConfig
from tests.support.tiny_model import build_number_model
from tests.support.trainer_batches import spread_batch

pytestmark = pytest.mark.slow  # minutes of processes

# the trainer service's settings: several micro-batches, none the padded path's; verl's fused log-prob kernel
FUSED = {"fused_backend": "torch"}
PACKED = FUSED | {"remove_padding": True, "micro_batch_tokens": 96}
PER_MICRO_BATCH = {"clip_cov", "kl_cov"}


@pytest.fixture(scope="module", autouse=True)
def plain_forward():
    """verl's fused kernel replaces the model class's forward for the rest of the process: keep the plain one
    (the HF reference below calls it) and put it back after this module, for later tests' plain HF models."""
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM.forward
    yield plain
    LlamaForCausalLM.forward = plain


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_number_model(tmp_path_factory.mktemp("packing") / "m")


@pytest.fixture(scope="module")
def batch():
    t = spread_batch(12, 8, 24, vocab=60, mean_fraction=0.3, group_size=4, seed=3)
    lengths = t["attention_mask"].sum(-1)
    assert lengths.max() > 2 * lengths.min()  # a spread batch: padding is most of the padded path's tokens
    return t


def engines(model_dir, algo, *, one_micro_batch: bool = False):
    from services.trainer.engine import PolicyEngine

    rows, packed = (12, PACKED | {"micro_batch_tokens": 10_000}) if one_micro_batch else (4, PACKED)
    built = []
    for options in (FUSED, packed):
        torch.manual_seed(0)  # the critic's value head is initialized at random: the same one for both
        built.append(PolicyEngine(str(model_dir), algo, micro_batch_size=rows, group_size=4, **options))
    return built


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
def test_packed_update_equals_padded(model_dir, batch, policy_loss):
    algo = AlgorithmConfig(lr=1e-2, adv_estimator="grpo", policy_loss=policy_loss, entropy_coeff=0.01)
    results = []
    for engine in engines(model_dir, algo, one_micro_batch=policy_loss in PER_MICRO_BATCH):
        log_probs, entropy = engine.log_probs(batch)
        advantages, _ = compute_advantages(algo, batch)
        behaviour = log_probs - 0.1 * batch["response_mask"]  # IS weights != 1 enter the loss
        metrics = engine.update(batch, behaviour, advantages, torch.ones_like(log_probs))
        after, _ = engine.log_probs(batch)
        results.append((log_probs, entropy, metrics, after))
    (lp_a, ent_a, m_a, after_a), (lp_b, ent_b, m_b, after_b) = results
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=1e-5)
    assert m_a["grad_norm"] > 0
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-4, abs=1e-6)
    assert m_b["grad_norm"] == pytest.approx(m_a["grad_norm"], rel=1e-4)
    torch.testing.assert_close(after_b, after_a, atol=1e-4, rtol=1e-4)  # the same optimizer step


def test_packed_critic_equals_padded(model_dir, batch):
    algo = AlgorithmConfig(lr=1e-2, adv_estimator="gae", critic_lr=1e-2, lam=0.95)
    results = []
    for engine in engines(model_dir, algo):
        values = engine.values(batch)
        _, returns = compute_advantages(algo, batch, values)
        metrics = engine.update_critic(batch, values, returns)
        results.append((values, metrics, engine.values(batch)))
    (v_a, m_a, after_a), (v_b, m_b, after_b) = results
    torch.testing.assert_close(v_b, v_a, atol=1e-5, rtol=1e-5)
    assert m_a["critic/vf_loss"] > 0
    assert m_b["critic/vf_loss"] == pytest.approx(m_a["critic/vf_loss"], rel=1e-4)
    assert m_b["grad_norm"] == pytest.approx(m_a["grad_norm"], rel=1e-4)
    torch.testing.assert_close(after_b, after_a, atol=1e-4, rtol=1e-4)


def test_token_budget_shapes_the_micro_batches(model_dir, batch):
    """The token budget, not the row count, decides the micro-batches: verl's dynamic batch size splits this
    batch into several micro-batches of at most `micro_batch_tokens` tokens (one longer sequence alone)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    _, packed = engines(model_dir, AlgorithmConfig(lr=1e-2, adv_estimator="grpo"))
    td = packed._tensordict(batch, compute_loss=False, micro_batch_size_per_gpu=4)
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=PACKED["micro_batch_tokens"])
    micro, _ = prepare_micro_batches(td)
    lengths = batch["attention_mask"].sum(-1)
    sizes = [int(m["input_ids"].offsets()[-1]) for m in micro]
    assert sum(sizes) == int(lengths.sum()) and len(micro) >= 2
    assert all(s <= max(PACKED["micro_batch_tokens"], int(lengths.max())) for s in sizes)


def test_packed_log_probs_equal_plain_hf(model_dir, batch, plain_forward):
    """The packed, fused path computes the model's own log-probs: a plain HF forward of each padded sequence."""
    from transformers import AutoModelForCausalLM

    _, packed = engines(model_dir, AlgorithmConfig(lr=1e-2, adv_estimator="grpo"))
    ours, _ = packed.log_probs(batch)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    prompt = batch["prompts"].shape[1]
    with torch.no_grad():
        logits = plain_forward(hf, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               position_ids=batch["position_ids"]).logits[:, prompt - 1:-1]
    direct = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(ours[mask], direct[mask], atol=1e-5, rtol=1e-5)


def test_an_untied_model_trains_packed(tmp_path, batch):
    """verl's fused log-prob kernel fails on an untied output layer under FSDP2 (it reads the still-sharded
    lm_head weight): the engine leaves it out for such a model and the trainer's settings still train it."""
    from services.trainer.engine import PolicyEngine
    from tests.support.tiny_model import build_tiny_model

    untied = build_tiny_model(tmp_path / "untied", vocab_size=64, hidden_size=32, tie_word_embeddings=False)
    algo = AlgorithmConfig(lr=1e-2, adv_estimator="grpo")
    engine = PolicyEngine(str(untied), algo, micro_batch_size=4, group_size=4, **PACKED)
    log_probs, _ = engine.log_probs(batch)
    advantages, _ = compute_advantages(algo, batch)
    metrics = engine.update(batch, log_probs - 0.1 * batch["response_mask"], advantages, torch.ones_like(log_probs))
    assert metrics["grad_norm"] > 0


@pytest.mark.parametrize("options", [FUSED, PACKED], ids=["padded", "packed"])
def test_compiled_layers_give_the_eager_step(model_dir, batch, options, monkeypatch):
    """`compile_layers` (each decoder layer's forward through torch.compile, FSDP2's hooks outside it) changes
    how the step runs, not what it computes: the same log-probs, loss, gradient norm and weights after it.
    Here dynamo's graphs run through AOTAutograd without inductor's code generation (`aot_eager`): what this
    checks is the capture of the layers under FSDP2 and their autograd; inductor's CPU C++ kernels, which no
    trainer runs, cost 3-4 minutes of compiling on 2 cores (`make gpu-smoke` compiles inductor's GPU kernels)."""
    import functools

    import torch._dynamo.utils

    from services.trainer.engine import PolicyEngine

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    algo = AlgorithmConfig(lr=1e-2, adv_estimator="grpo")
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        engine = PolicyEngine(str(model_dir), algo, micro_batch_size=4, group_size=4, compile_layers=compiled,
                              **options)
        log_probs, _ = engine.log_probs(batch)
        advantages, _ = compute_advantages(algo, batch)
        metrics = engine.update(batch, log_probs.detach(), advantages, torch.ones_like(log_probs))
        after, _ = engine.log_probs(batch)
        results.append((log_probs, metrics, after, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs))
    (lp_a, m_a, after_a, graphs_eager), (lp_b, m_b, after_b, graphs_compiled) = results
    assert graphs_eager == 0 and graphs_compiled > 0  # the compiled engine did run compiled layers
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-4, abs=1e-6)
    assert m_b["grad_norm"] == pytest.approx(m_a["grad_norm"], rel=1e-4)
    torch.testing.assert_close(after_b, after_a, atol=1e-4, rtol=1e-4)
