"""Request spans: W3C traceparent in and out, sampling, the in-memory exporter and a real OTLP/HTTP receiver."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.observability.tracing import RequestTracer, TraceSettings

REPO = Path(__file__).resolve().parents[2]
CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"  # the W3C spec's example


@pytest.fixture
def traced() -> Iterator[tuple[RequestTracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(TraceSettings(enabled=True), exporter=exporter)
    yield tracer, exporter
    tracer.shutdown()


def test_a_clients_trace_is_continued_and_returned(traced: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = traced
    span = tracer.start("/v1/chat/completions", CLIENT, protocol="h2", now_ns=1_000)
    assert span is not None
    version, trace_id, span_id, flags = span.traceparent.split("-")
    assert (version, trace_id, flags) == ("00", "4bf92f3577b34da6a3ce929d0e0e4736", "01")
    assert span_id != "00f067aa0ba902b7" and span.trace_id == trace_id  # our own span, same trace
    span.first_token(now_ns=3_000)
    span.end(200, model="tiny", completion_tokens=8, now_ns=9_000)
    (got,) = exporter.get_finished_spans()
    assert got.name == "POST /v1/chat/completions" and got.kind is SpanKind.SERVER
    assert got.parent is not None and got.parent.span_id == 0x00F067AA0BA902B7 and got.parent.is_remote
    assert f"{got.context.span_id:016x}" == span_id
    assert (got.start_time, got.end_time, got.events[0].name, got.events[0].timestamp) == (1_000, 9_000,
                                                                                         "first_token", 3_000)
    assert got.attributes is not None
    assert got.attributes["gen_ai.request.model"] == "tiny" and got.attributes["http.response.status_code"] == 200
    assert got.attributes["network.protocol.name"] == "h2"
    assert got.status.status_code is StatusCode.UNSET


@pytest.mark.parametrize("bad", [None, "", "garbage", "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                                 "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"])
def test_no_or_malformed_traceparent_starts_a_new_trace(traced: tuple[RequestTracer, InMemorySpanExporter],
                                                        bad: str | None) -> None:
    tracer, exporter = traced
    span = tracer.start("/v1/completions", bad)
    assert span is not None and span.trace_id not in ("4bf92f3577b34da6a3ce929d0e0e4736", "0" * 32)
    span.end(503, error="no worker")
    (got,) = exporter.get_finished_spans()
    assert got.parent is None and got.status.status_code is StatusCode.ERROR and got.status.description == "no worker"


def _sampled(traceparent: str) -> bool:
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)  # bit 0; bit 1 (random trace id) may be set too


def test_sampling_follows_the_client_and_the_ratio() -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(TraceSettings(enabled=True, sample_ratio=0.0), exporter=exporter)
    unsampled = tracer.start("/v1/models", None)
    assert unsampled is not None and not _sampled(unsampled.traceparent)  # propagated, not recorded
    unsampled.end(200)
    sampled_by_client = tracer.start("/v1/models", CLIENT)
    assert sampled_by_client is not None and _sampled(sampled_by_client.traceparent)
    sampled_by_client.end(200)
    assert [s.context.trace_id for s in exporter.get_finished_spans()] == [0x4BF92F3577B34DA6A3CE929D0E0E4736]
    tracer.shutdown()


def test_off_costs_nothing_and_imports_nothing() -> None:
    """Off (the default): start() returns None and OpenTelemetry is never imported into the gateway."""
    code = ("import sys; from gateway.observability.tracing import RequestTracer, TraceSettings; "
            "t = RequestTracer(TraceSettings()); assert t.start('/v1/models', 'x') is None; t.shutdown(); "
            "print(any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_settings_are_checked() -> None:
    problems: list[str] = []
    TraceSettings(enabled=True, sample_ratio=1.5, otlp_endpoint="collector:4318")._validate(problems)
    assert len(problems) == 2


class _Receiver(BaseHTTPRequestHandler):
    got: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        self.got.append((self.path, self.headers["content-type"], body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_spans_reach_a_real_otlp_http_receiver() -> None:
    """The default exporter (batching, OTLP/HTTP protobuf) against a receiver bound here on port 0."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        tracer = RequestTracer(TraceSettings(enabled=True, otlp_endpoint=endpoint, service_name="gw-test"))
        span = tracer.start("/v1/chat/completions", CLIENT)
        assert span is not None
        span.end(200, model="tiny")
        tracer.shutdown()  # flushes the batch
    finally:
        server.shutdown()
        thread.join()
    (path, ctype, body), = _Receiver.got
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    req = ExportTraceServiceRequest.FromString(body)
    (rs,) = req.resource_spans
    service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
    ((sp,),) = [ss.spans for ss in rs.scope_spans]
    assert service == "gw-test" and sp.name == "POST /v1/chat/completions"
    assert sp.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736" and sp.parent_span_id.hex() == "00f067aa0ba902b7"
