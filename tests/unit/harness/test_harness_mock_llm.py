"""tests/support/mock_llm.py speaks the completions protocol the openai engine uses (ids in, ids + logprobs out)."""

import httpx

from tests.support.mock_llm import MockLLM


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


async def test_reload_routes_hold_requests_while_paused_and_set_the_version():
    import asyncio

    app = MockLLM(latency_s=0.05)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as client:
        before = asyncio.create_task(client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}))
        await asyncio.sleep(0.01)
        (await client.post("/pause", params={"mode": "wait"})).raise_for_status()
        assert before.done() and app.in_flight == 0  # pause returned after the request in flight finished
        held = asyncio.create_task(client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}))
        await asyncio.sleep(0.1)
        assert not held.done()  # no generation while paused
        rpc = await client.post("/collective_rpc", json={"method": "flywheel_reload", "kwargs": {"weights_path": "x"}})
        assert rpc.json()["results"] == [{"ok": True}]  # what reload_failure() reads as every worker reloaded
        for path, body in (("/reset_prefix_cache", None), ("/update_weight_version", {"new_version": "3"}),
                           ("/resume", None)):
            (await client.post(path, json=body)).raise_for_status()
        assert (await held).json()["weight_version"] == 3
        assert (await before).json()["weight_version"] == 0
