"""An agent program's model calls are `generate` spans under its unit's `rollout` span, though the gateway's HTTP
handlers run outside that span: the session keeps the rollout's traceparent from when it was opened."""

from __future__ import annotations

import time
from types import SimpleNamespace

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.rollout_worker.chat_assembly import Prompt
from services.rollout_worker.engines.base import SamplingParams
from services.rollout_worker.gateway import Gateway
from shared.contracts.run_config import RunConfig
from shared.platform import tracing


class Engine:
    async def generate(self, ids, sampling, max_tokens):
        return SimpleNamespace(ids=[7, 8, 9], text="ok", logprobs=[-0.1] * 3, weight_version=4,
                               finish_reason="stop")


async def test_a_gateway_call_is_a_generate_span_under_the_units_rollout_span():
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        config = RunConfig(name="r", model="m", dataset="d", agent={"name": "math"}, env={"name": "math"},
                           samples_per_task=2)
        ctx = SimpleNamespace(config=config, chat=SimpleNamespace(tokenizer=SimpleNamespace(chat_template="")),
                              engine=Engine(), sampling=lambda greedy: SamplingParams())
        gateway = Gateway()
        with tracing.span("rollout", root=True):
            session = gateway.open(ctx, False, time.monotonic() + 30)
        # a later HTTP request: no span is current here
        await gateway._generate(session, {}, Prompt(ids=[1, 2, 3], segment=None))
    finally:
        tracing.install(None)
        provider.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    rollout, generate = spans["rollout"], spans["generate"]
    assert generate.parent is not None and generate.parent.span_id == rollout.context.span_id
    assert generate.context.trace_id == rollout.context.trace_id
    assert dict(generate.attributes) == {"prompt_tokens": 3, "tokens": 3, "weight_version": 4}
