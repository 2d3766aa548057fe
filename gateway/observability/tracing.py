"""OpenTelemetry traces: one server span per request, W3C ``traceparent`` in and out, OTLP export.

Why this shape: tracing is off by default and the request path must not pay for
it then, so :class:`RequestTracer` imports OpenTelemetry only when enabled and
``start`` is one attribute test when not. When on, each request gets a SERVER
span whose parent is the client's ``traceparent`` header (W3C Trace Context; a
malformed one starts a new trace, as the spec says), and the span's own
``traceparent`` is what the gateway returns in the response header and puts on
``Submit.trace`` so the worker's spans (queue wait, prefill, decode) join the
same trace. Export is OTLP over HTTP/protobuf to ``otlp_endpoint`` through a
batching processor (spans leave on a background thread, never on the loop);
tests pass their own exporter.

Pipeline hooks (the lead wires them): ``span = tracer.start(route, traceparent,
now_ns=...)`` at admission; ``span.traceparent`` into the response headers and
``Submit.trace = {"traceparent": span.traceparent}``; ``span.first_token()`` on
the first token; ``span.end(status, model=..., error=...)`` at the end of the
request; ``tracer.shutdown()`` after the drain.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import clock

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["RequestSpan", "RequestTracer", "TraceSettings"]


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """The ``[tracing]`` settings section (to be mounted in :mod:`gateway.settings`)."""

    enabled: bool = False
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"  # OTLP/HTTP collector
    sample_ratio: float = 1.0  # of new traces; a client's sampled flag is followed (parent-based)
    service_name: str = "quicserve-gateway"

    def _validate(self, p: list[str]) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            p.append(f"tracing.sample_ratio: {self.sample_ratio} is not in 0..1")
        if self.enabled and not self.otlp_endpoint.startswith(("http://", "https://")):
            p.append(f"tracing.otlp_endpoint: {self.otlp_endpoint!r} is not an http(s) URL")


class RequestSpan:
    """One request's server span; :attr:`traceparent` names it for the response and the worker."""

    __slots__ = ("_span", "traceparent", "trace_id")

    def __init__(self, span: Any, traceparent: str) -> None:
        self._span = span
        self.traceparent = traceparent
        self.trace_id = traceparent[3:35]  # for logs: the 32 hex digits

    def first_token(self, now_ns: int | None = None) -> None:
        self._span.add_event("first_token", timestamp=now_ns)

    def end(self, status: int, *, model: str = "", error: str = "", completion_tokens: int | None = None,
            now_ns: int | None = None, route: str = "") -> None:
        from opentelemetry.trace import Status, StatusCode

        span = self._span
        span.set_attribute("http.response.status_code", status)
        if route:
            span.set_attribute("quicserve.route", route)  # the routing rule that chose the model
        if model:
            span.set_attribute("gen_ai.request.model", model)
        if completion_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if status >= 500:  # a 4xx is the client's; the server span stays unset (OTel HTTP conventions)
            span.set_status(Status(StatusCode.ERROR, error or None))
        span.end(end_time=now_ns)


class RequestTracer:
    """Server spans for requests, or nothing at all when tracing is off."""

    def __init__(self, settings: TraceSettings, exporter: SpanExporter | None = None) -> None:
        self.enabled = settings.enabled
        self._provider: Any = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}),
                                        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # Short export timeouts: an unreachable collector must not hold the drain (the shutdown flush
            # exports what is queued, and each export otherwise retries for 10 s).
            exporter_ = OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=2.0)
            self._provider.add_span_processor(BatchSpanProcessor(exporter_, export_timeout_millis=2000))
        else:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("quicserve.gateway")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, route: str, traceparent: str | None = None, *, method: str = "POST", protocol: str = "",
              attributes: Mapping[str, str | int] | None = None, now_ns: int | None = None) -> RequestSpan | None:
        """A span for one request, child of the client's ``traceparent`` if it is valid; None when off."""
        if not self.enabled:
            return None
        from opentelemetry.trace import SpanKind, set_span_in_context

        parent = self._propagator.extract({"traceparent": traceparent}) if traceparent else None
        attrs: dict[str, str | int] = {"http.request.method": method, "http.route": route}
        if protocol:
            attrs["network.protocol.name"] = protocol
        if attributes:
            attrs.update(attributes)
        span = self._tracer.start_span(f"{method} {route}", context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                       start_time=now_ns if now_ns is not None else clock.wall_ns())
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return RequestSpan(span, carrier["traceparent"])

    def shutdown(self) -> None:
        """Flush spans still queued for export (at the end of the drain)."""
        if self._provider is not None:
            self._provider.shutdown()
