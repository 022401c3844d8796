"""shared/platform/tracing.py: off (no endpoint) every helper is a no-op and messages carry no traceparent; on,
a span's traceparent crosses a message's encode/decode and the receiver's span is its child."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN

from shared.contracts.messages import RolloutTask, decode, encode
from shared.platform import tracing
from shared.platform.settings import ServiceSettings


@pytest.fixture
def exporter():
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)


def test_without_an_endpoint_tracing_is_a_no_op(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert tracing.setup_tracing("svc", ServiceSettings().otel_exporter_otlp_endpoint) is False
    assert not tracing.enabled()
    with tracing.span("dispatch", root=True, run_id="r") as span:
        assert span is INVALID_SPAN and tracing.traceparent() is None
    assert tracing.start_span("store", None) is INVALID_SPAN
    assert tracing.link(None) == [] and tracing.trace_id(None) is None


def test_the_standard_variable_turns_tracing_on(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318")
    endpoint = ServiceSettings().otel_exporter_otlp_endpoint
    assert endpoint == "http://jaeger:4318"
    try:
        assert tracing.setup_tracing("svc", endpoint) is True and tracing.enabled()
    finally:
        tracing.install(None)  # no span was made, so nothing is ever sent


def test_a_traceparent_crosses_a_message_and_the_receiver_is_a_child(exporter):
    with tracing.span("dispatch", root=True, run_id="r") as parent:
        task = RolloutTask(run_id="r", task_id="t", sample_idx=0, task={}, dispatched_at=time.time(),
                           traceparent=tracing.traceparent())
    received = decode(encode(task), RolloutTask)
    with tracing.span("rollout", received.traceparent, attempt=None) as child:  # None attributes are left out
        pass
    assert child.parent.span_id == parent.context.span_id
    assert child.context.trace_id == parent.context.trace_id
    assert tracing.trace_id(received.traceparent) == format(parent.context.trace_id, "032x")
    assert [lk.context.span_id for lk in tracing.link(received.traceparent)] == [parent.context.span_id]
    assert [s.name for s in exporter.get_finished_spans()] == ["dispatch", "rollout"]
    assert "attempt" not in exporter.get_finished_spans()[1].attributes


def test_a_root_span_starts_its_own_trace_inside_another(exporter):
    with tracing.span("outer", root=True) as outer, tracing.span("train.step", root=True) as step:
        assert step.context.trace_id != outer.context.trace_id and step.parent is None
