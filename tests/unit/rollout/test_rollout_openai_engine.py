"""The openai engine against a fake OpenAI-compatible server (httpx MockTransport): the wire protocol of
ports.md, retries of transient errors, InferenceError after the retries."""

import json

import httpx
import pytest

from services.rollout_worker.engines import InferenceError, SamplingParams, build_engine
from shared.run_config import EngineConfig


class FakeServer:
    def __init__(self, failures: int = 0, status: int = 503):
        self.failures, self.status, self.bodies = failures, status, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.failures > 0:
            self.failures -= 1
            return httpx.Response(self.status)
        body = json.loads(request.content)
        self.bodies.append(body)
        return httpx.Response(200, json={
            "weight_version": 7,
            "choices": [{"text": "\\boxed{4}", "token_ids": [11, 12, 13], "finish_reason": "length",
                         "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]}}],
        })


def engine_with(server: FakeServer, retries: int = 2):
    cfg = EngineConfig(type="openai", base_url="http://fake/v1", max_retries=retries)
    engine = build_engine("openai", "tiny", cfg, tokenizer=None)
    engine.client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    return engine


async def test_request_and_response_follow_the_protocol():
    server = FakeServer()
    engine = engine_with(server)
    gen = await engine.generate([1, 2, 3], SamplingParams(temperature=0.7, top_p=0.9, stop=("</s>",)), 16)
    body = server.bodies[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 16 and body["logprobs"] == 1
    assert body["return_token_ids"] is True and body["stop"] == ["</s>"] and body["temperature"] == 0.7
    assert gen.ids == [11, 12, 13] and gen.logprobs == [-0.1, -0.2, -0.3]
    assert gen.finish_reason == "length" and gen.weight_version == 7 and gen.text == "\\boxed{4}"


async def test_transient_errors_are_retried():
    server = FakeServer(failures=2)
    gen = await engine_with(server, retries=2).generate([1], SamplingParams(), 4)
    assert gen.ids == [11, 12, 13]


async def test_persistent_errors_raise_inference_error():
    with pytest.raises(InferenceError, match="failed after 2 attempts"):
        await engine_with(FakeServer(failures=10), retries=1).generate([1], SamplingParams(), 4)
    with pytest.raises(InferenceError, match="400"):  # our request is wrong: not retried
        await engine_with(FakeServer(failures=1, status=400), retries=3).generate([1], SamplingParams(), 4)


def test_unknown_engine_type_is_rejected():
    with pytest.raises(ValueError, match="unknown engine type"):
        build_engine("tgi", "m", EngineConfig(), tokenizer=None)
