"""Worker spans for traced requests: queue wait, prefill, decode, children of the gateway's span.

How it works: a request whose ``Submit.trace`` carries a W3C ``traceparent`` gets a
timeline -- arrival, the start of the step that produced its first token (its
prefill), the first token, the end. Nothing is exported while the request runs;
when it ends the three spans are made at once with those timestamps (``queue``:
arrival to prefill, ``prefill``: to the first token, ``decode``: to the end), so
the engine loop does a dict lookup per traced request and step, and nothing at
all for untraced ones or when tracing is off (``--otlp-endpoint`` unset: then
OpenTelemetry is not even imported). Export is OTLP/HTTP through a batching
processor, off the event loop; tests pass their own exporter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["WorkerTracer"]


@dataclass(slots=True)
class _Timeline:
    traceparent: str
    arrival: int
    prefill: int = 0
    first_token: int = 0


class WorkerTracer:
    """Records traced requests' timelines and exports their spans when they end; a no-op when off."""

    def __init__(self, otlp_endpoint: str = "", *, exporter: SpanExporter | None = None,
                 service_name: str = "quicserve-worker", clock: Callable[[], int] = time.time_ns) -> None:
        self.enabled = bool(otlp_endpoint) or exporter is not None
        self.clock = clock
        self.open: dict[Hashable, _Timeline] = {}
        self._step_started = 0
        self._provider: Any = None
        if not self.enabled:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # Parent-based by default: the gateway (or its client) decided whether this trace is sampled.
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
        else:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("quicserve.worker")
        self._propagator = TraceContextTextMapPropagator()

    def submitted(self, key: Hashable, trace: Mapping[str, str] | None) -> None:
        if self.enabled and trace and (tp := trace.get("traceparent")):
            self.open[key] = _Timeline(tp, self.clock())

    def step_started(self) -> None:
        """A step is about to run: the prefill of any traced request whose first token it yields."""
        if self.open:
            self._step_started = self.clock()

    def token(self, key: Hashable) -> None:
        t = self.open.get(key)
        if t is not None and not t.first_token:
            t.prefill = self._step_started or t.arrival
            t.first_token = self.clock()

    def ended(self, key: Hashable, *, error: str = "", completion_tokens: int = 0, cached_tokens: int = 0) -> None:
        t = self.open.pop(key, None)
        if t is None:
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        end = self.clock()
        parent = self._propagator.extract({"traceparent": t.traceparent})
        spans = [("queue", t.arrival, t.prefill or end)]
        if t.first_token:
            spans += [("prefill", t.prefill, t.first_token), ("decode", t.first_token, end)]
        for name, start, stop in spans:
            span = self._tracer.start_span(name, context=parent, kind=SpanKind.INTERNAL, start_time=start)
            if name == "prefill":
                span.set_attribute("gen_ai.usage.cached_tokens", cached_tokens)
            if name == "decode":
                span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
            if error and name == spans[-1][0]:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end(end_time=stop)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
