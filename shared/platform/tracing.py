"""OpenTelemetry traces of one unit's life (dispatch -> rollout -> env steps -> store -> training step), linked
across processes by a W3C `traceparent` string that the stream messages carry.

A service exports spans over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set (`setup_tracing`, called by
`setup_service`); otherwise every helper here returns at once and no message carries a traceparent. Tests
`install` a provider with an in-memory exporter.

More: docs/observability.md
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Link, Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # None: tracing is off, every helper is a no-op


def setup_tracing(service: str, endpoint: str | None) -> bool:
    """Export this process's spans to `endpoint` (an OTLP/HTTP collector, e.g. Jaeger's :4318) as `service`;
    returns whether tracing is on. The SDK is imported only when it is."""
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))  # flushed at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")))
    install(provider)
    return True


def install(provider: trace.TracerProvider | None) -> None:
    """Use `provider` for this process's spans (None: tracing off). Our own global, not OpenTelemetry's, which
    can be set only once per process: tests install and remove providers freely."""
    global _tracer
    _tracer = provider.get_tracer("flywheel") if provider is not None else None


def enabled() -> bool:
    return _tracer is not None


def context_of(traceparent: str | None) -> Context | None:
    """The remote parent a message's traceparent names (None: none, the span starts its own trace)."""
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None


@contextmanager
def span(name: str, traceparent: str | None = None, *, root: bool = False, links: list[Link] | None = None,
         start: float | None = None, **attributes: Any) -> Iterator[Span]:
    """A span, current inside the block: a child of the current span, or of `traceparent` when given (a
    message from another process), or a new trace's root (`root`). `start`: unix seconds it began, when that
    was before the block (a queue wait)."""
    if _tracer is None:
        yield INVALID_SPAN
        return
    parent = Context() if root else context_of(traceparent)
    with _tracer.start_as_current_span(name, context=parent, links=links, attributes=_attrs(attributes),
                                       start_time=_ns(start)) as s:
        yield s


def start_span(name: str, traceparent: str | None = None, *, start: float | None = None, **attributes: Any) -> Span:
    """A span the caller ends (`.end()`), not made current: one per message of a batch handled together, or
    one that began before now (`start`, unix seconds: a queue wait)."""
    if _tracer is None:
        return INVALID_SPAN
    return _tracer.start_span(name, context=context_of(traceparent), attributes=_attrs(attributes),
                              start_time=_ns(start))


def traceparent(of: Span | None = None) -> str | None:
    """The W3C traceparent of `of` (default: the current span) to put in a message; None when tracing is off."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(of) if of is not None else None)
    return carrier.get("traceparent")


def trace_id(traceparent: str | None) -> str | None:
    """The 32-hex trace id a traceparent names (what Jaeger looks traces up by)."""
    sc = _span_context(traceparent)
    return format(sc.trace_id, "032x") if sc is not None else None


def link(traceparent: str | None) -> list[Link]:
    """A link to the span a traceparent names ([] when none): a span that serves many units (a training step)
    points at each unit's trace instead of joining one."""
    sc = _span_context(traceparent)
    return [Link(sc)] if sc is not None else []


def _span_context(traceparent: str | None) -> trace.SpanContext | None:
    ctx = context_of(traceparent)
    sc = trace.get_current_span(ctx).get_span_context() if ctx is not None else None
    return sc if sc is not None and sc.is_valid else None


def _attrs(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}  # OpenTelemetry refuses None values


def _ns(unix_s: float | None) -> int | None:
    return int(unix_s * 1e9) if unix_s is not None else None
