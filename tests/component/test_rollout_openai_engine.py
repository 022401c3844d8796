"""The openai engine against a fake OpenAI-compatible server on loopback (aiohttp.web): the wire protocol of
ports.md, retries of transient errors, InferenceError after the retries."""

import pytest
from aiohttp import web

from services.rollout_worker.engines import InferenceError, SamplingParams, build_engine
from shared.contracts.run_config import EngineConfig


class FakeServer:
    def __init__(self, failures: int = 0, status: int = 503, logprobs=(-0.1, -0.2, -0.3)):
        self.failures, self.status, self.bodies = failures, status, []
        self.logprobs = {"token_logprobs": list(logprobs)} if logprobs is not None else None

    async def __call__(self, request: web.Request) -> web.Response:
        if self.failures > 0:
            self.failures -= 1
            return web.Response(status=self.status, text="busy")
        self.bodies.append(await request.json())
        return web.json_response({
            "weight_version": 7,
            "choices": [{"text": "\\boxed{4}", "token_ids": [11, 12, 13], "finish_reason": "length",
                         "logprobs": self.logprobs}],
        })


@pytest.fixture
async def serve():
    runners = []

    async def start(server: FakeServer, retries: int = 2):
        async def completions(request: web.Request) -> web.Response:
            return await server(request)

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        cfg = EngineConfig(type="openai", base_url=f"http://127.0.0.1:{port}/v1", max_retries=retries)
        engine = build_engine("openai", "tiny", cfg, tokenizer=None)
        runners.append(engine)
        return engine

    yield start
    for r in reversed(runners):
        await (r.cleanup() if isinstance(r, web.AppRunner) else r.close())


async def test_request_and_response_follow_the_protocol(serve):
    server = FakeServer()
    engine = await serve(server)
    gen = await engine.generate([1, 2, 3], SamplingParams(temperature=0.7, top_p=0.9, stop=("</s>",)), 16)
    body = server.bodies[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 16 and body["logprobs"] == 1
    assert body["return_token_ids"] is True and body["stop"] == ["</s>"] and body["temperature"] == 0.7
    assert gen.ids == [11, 12, 13] and gen.logprobs == [-0.1, -0.2, -0.3]
    assert gen.finish_reason == "length" and gen.weight_version == 7 and gen.text == "\\boxed{4}"


async def test_transient_errors_are_retried(serve):
    server = FakeServer(failures=2)
    gen = await (await serve(server, retries=2)).generate([1], SamplingParams(), 4)
    assert gen.ids == [11, 12, 13]


async def test_persistent_errors_raise_inference_error(serve):
    with pytest.raises(InferenceError, match="failed after 2 attempts"):
        await (await serve(FakeServer(failures=10), retries=1)).generate([1], SamplingParams(), 4)
    bad_request = FakeServer(failures=1, status=400)
    with pytest.raises(InferenceError, match="400"):  # our request is wrong: not retried
        await (await serve(bad_request, retries=3)).generate([1], SamplingParams(), 4)
    assert bad_request.failures == 0 and bad_request.bodies == []


@pytest.mark.parametrize("logprobs", [None, [], [-0.1, -0.2], [-0.1, None, -0.3]],
                         ids=["absent", "empty", "short", "null"])
async def test_a_reply_without_every_logprob_is_an_inference_error(serve, logprobs):
    """Behaviour logprobs are never made up (the old engine filled in 0.0): the episode fails as an
    infrastructure error and is retried, instead of training on a guess."""
    with pytest.raises(InferenceError, match="usable logprobs"):
        await (await serve(FakeServer(logprobs=logprobs))).generate([1], SamplingParams(), 4)


def test_unknown_engine_type_is_rejected():
    with pytest.raises(ValueError, match="unknown engine type"):
        build_engine("tgi", "m", EngineConfig(), tokenizer=None)
