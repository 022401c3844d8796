"""bench/mock_llm.py speaks the completions protocol the openai engine uses (ids in, ids + logprobs out)."""

import httpx

from bench.mock_llm import MockLLM


async def post(app: MockLLM, body: dict) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as client:
        resp = await client.post("/v1/completions", json=body)
        resp.raise_for_status()
        return resp.json()


async def test_answers_arithmetic_with_the_boxed_result():
    out = await post(MockLLM(latency_s=0), {"model": "m", "prompt": "Q: What is 12 * 7? Think.", "max_tokens": 64,
                                            "logprobs": 1, "return_token_ids": True})
    choice = out["choices"][0]
    assert "\\boxed{84}" in choice["text"] and choice["finish_reason"] == "stop"
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
    assert out["weight_version"] == 0


async def test_fixed_answer_and_truncation():
    out = await post(MockLLM(latency_s=0, answer="\\boxed{5} and more"), {"prompt": [1, 2, 3], "max_tokens": 4})
    choice = out["choices"][0]
    assert choice["text"] == "\\box" and choice["finish_reason"] == "length" and len(choice["token_ids"]) == 4
