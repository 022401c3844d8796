"""The hf engine's prompt scores beyond logprobs: the logprobs of target ids, and alt tokens drawn per position."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.rollout_worker.engines import UnservedRequest  # noqa: E402
from services.rollout_worker.engines.hf import alt_draws, target_logprobs  # noqa: E402


def test_target_logprobs_pick_each_rows_ids_and_leave_unasked_cells_zero():
    distributions = torch.log_softmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(0)), dim=-1)
    got = target_logprobs(distributions, ((4, -1), (-1, -1), (10, 0)))
    assert got[0] == [pytest.approx(distributions[0, 4].item()), 0.0]
    assert got[1] == [0.0, 0.0]
    assert got[2] == [pytest.approx(distributions[2, 10].item()), pytest.approx(distributions[2, 0].item())]


def test_target_logprobs_refuse_an_id_outside_the_vocabulary_or_a_wrong_row_count():
    distributions = torch.log_softmax(torch.zeros(2, 5), dim=-1)
    with pytest.raises(UnservedRequest, match="token id 5, outside the model's vocabulary of 5"):
        target_logprobs(distributions, ((5,), (0,)))
    with pytest.raises(UnservedRequest, match="3 rows for a prompt of 3 tokens"):
        target_logprobs(distributions, ((0,), (0,), (0,)))


def test_alt_draws_follow_the_tempered_distribution_and_carry_its_logprobs():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    torch.manual_seed(0)
    rows = alt_draws(logits, 4000, temperature=0.5)
    tempered = torch.log_softmax(logits / 0.5, dim=-1)
    for r, row in enumerate(rows):
        assert len(row) == 4000
        for token, lp in row[:50]:
            assert lp == pytest.approx(tempered[r, token].item(), abs=1e-6)
        frequency = sum(token == 1 for token, _ in row) / len(row) if r == 0 else \
            sum(token == 0 for token, _ in row) / len(row)
        assert frequency == pytest.approx(tempered[r].exp().max().item(), abs=0.03)


def test_alt_draws_at_temperature_zero_repeat_the_likeliest_token():
    logits = torch.tensor([[0.0, 2.0, -1.0], [5.0, 0.0, 1.0]])
    rows = alt_draws(logits, 3, temperature=0.0)
    untempered = torch.log_softmax(logits, dim=-1)
    assert [[t for t, _ in row] for row in rows] == [[1, 1, 1], [0, 0, 0]]
    assert rows[1][0][1] == pytest.approx(untempered[1, 0].item())


@pytest.mark.parametrize("engine_module,engine_class", [("vllm", "VLLMEngine"), ("openai", "OpenAIEngine")])
def test_engines_that_cannot_score_target_ids_refuse_them_by_name(engine_module, engine_class):
    import asyncio
    import importlib

    from services.rollout_worker.engines import SamplingParams

    cls = getattr(importlib.import_module(f"services.rollout_worker.engines.{engine_module}"), engine_class)
    engine = object.__new__(cls)  # refused before the engine is touched
    for asked in (SamplingParams(prompt_targets=((3,),)), SamplingParams(prompt_alt_k=2)):
        with pytest.raises(UnservedRequest, match="prompt alt tokens .*by engine type hf"):
            asyncio.run(engine.generate([1, 2], asked, 1))
