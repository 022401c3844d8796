"""The long-horizon benchmark's pure parts: the growth-exponent fit (tests/support/growth.py) and the mock LLM's
tool-calling workload (tests/support/mock_llm.py: ToolCalls) being what was configured, the same under a seed."""

import statistics

import httpx
import pytest

from services.rollout_worker.builtin.agents import parse_tool_calls
from tests.support.growth import exponents, growth_exponent
from tests.support.mock_llm import MockLLM, ToolCalls, prompt_key


def test_the_fit_recovers_the_power_of_a_power_law():
    turns = [4, 16, 32]
    assert growth_exponent(turns, [3.0 * t for t in turns]) == pytest.approx(1.0)
    assert growth_exponent(turns, [0.5 * t ** 2 for t in turns]) == pytest.approx(2.0)
    assert growth_exponent(turns, [7.0] * 3) == pytest.approx(0.0)
    assert growth_exponent([4, 4], [1.0, 2.0]) is None  # one x: no slope


def test_the_fit_is_least_squares_in_log_space():
    # a + b * t (fixed + linear cost) grows slower than linear at small t: the exponent is below 1
    k = growth_exponent([4, 16, 32], [100 + 10 * t for t in (4, 16, 32)])
    assert 0.3 < k < 0.8


def test_exponents_per_tokens_per_turn_series_and_their_mean():
    cells = [{"turns": t, "tokens_per_turn": 128, "b": 10.0 * t} for t in (4, 16, 32)]
    cells += [{"turns": t, "tokens_per_turn": 1024, "b": float(t * t)} for t in (4, 16)]
    cells += [{"turns": 4, "tokens_per_turn": 4096, "b": 1.0}]
    out = exponents(cells, "b")
    assert out["by_tokens_per_turn"] == {"128": 1.0, "1024": 2.0, "4096": None}
    assert out["mean"] == 1.5
    assert out["last_two_by_tokens_per_turn"] == {"128": 1.0, "1024": 2.0, "4096": None}
    fixed_plus_quadratic = [{"turns": t, "tokens_per_turn": 1, "b": 1000.0 + t * t} for t in (4, 16, 32)]
    out = exponents(fixed_plus_quadratic, "b")
    assert out["by_tokens_per_turn"]["1"] < out["last_two_by_tokens_per_turn"]["1"] < 2


def test_lengths_have_the_configured_mean_and_a_long_tail_and_the_malformed_share():
    tc = ToolCalls(mean_tokens=256, sigma=1.0, malformed=0.2, seed=3)
    draws = [tc.draw(k) for k in range(20000)]
    lengths = sorted(n for n, _, _ in draws)
    assert statistics.fmean(lengths) == pytest.approx(256, rel=0.05)
    assert statistics.median(lengths) == pytest.approx(256 * 0.6065, rel=0.05)  # exp(-sigma^2 / 2)
    assert lengths[int(0.99 * len(lengths))] > 4 * 256  # the tail
    assert sum(bad for _, bad, _ in draws) / len(draws) == pytest.approx(0.2, abs=0.01)


def test_draws_are_fixed_by_the_seed_and_the_request():
    a, b = ToolCalls(seed=1), ToolCalls(seed=2)
    assert [a.draw(k) for k in range(50)] == [ToolCalls(seed=1).draw(k) for k in range(50)]
    assert [a.draw(k) for k in range(50)] != [b.draw(k) for k in range(50)]


async def post(app: MockLLM, body: dict) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as client:
        resp = await client.post("/v1/completions", json=body)
        resp.raise_for_status()
        return resp.json()["choices"][0]


async def test_replies_end_in_a_qwen_tool_call_of_the_drawn_length():
    app = MockLLM(latency_s=0, tool_calls=ToolCalls(tool="search", mean_tokens=300, malformed=0.3, seed=0))
    kinds = set()
    for i in range(40):
        prompt = [i, 7, 9]
        choice = await post(app, {"prompt": prompt, "max_tokens": 100_000})
        length, malformed, word = app.tool_calls.draw(prompt_key(prompt))
        call_len = len(app.encode(app.tool_calls.call_text(malformed, word)))
        assert len(choice["token_ids"]) == max(length, call_len) == len(choice["logprobs"]["token_logprobs"])
        (call,) = parse_tool_calls(choice["text"])
        assert call["name"] == ("invalid_tool_call" if malformed else "search")
        kinds.add(call["name"])
        assert choice == await post(app, {"prompt": prompt, "max_tokens": 100_000})  # same prompt, same reply
    assert kinds == {"search", "invalid_tool_call"}


async def test_a_long_draw_is_cut_at_max_tokens_with_the_call_kept():
    app = MockLLM(latency_s=0, tool_calls=ToolCalls(mean_tokens=5000, sigma=0.1, malformed=0.0))
    choice = await post(app, {"prompt": [1, 2, 3], "max_tokens": 200})
    assert len(choice["token_ids"]) == 200 and choice["finish_reason"] == "length"
    assert parse_tool_calls(choice["text"])[0]["name"] == "search"
