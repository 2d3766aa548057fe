"""Worker spans of a traced request: queue, prefill and decode under the gateway's span, in order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from inference.service import WorkerService
from inference.tracing import WorkerTracer
from tests.inference.test_service import RecordingConnection, make_service, run_until
from transport.messages import SamplingParams, Submit

REPO = Path(__file__).resolve().parents[2]
GATEWAY_SPAN = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def traced_service() -> tuple[InMemorySpanExporter, WorkerService, RecordingConnection]:
    """A service with an in-memory exporter and request 1 (5 tokens) submitted under the gateway's span."""
    exporter = InMemorySpanExporter()
    svc = make_service(tracer=WorkerTracer(exporter=exporter))
    conn = RecordingConnection()
    svc.on_submit(conn, Submit(1, "tiny", SamplingParams(max_tokens=5), prompt="hello",
                               trace={"traceparent": GATEWAY_SPAN}))
    return exporter, svc, conn


async def test_traced_request_gets_queue_prefill_decode_spans() -> None:
    exporter, svc, conn = traced_service()
    svc.on_submit(conn, Submit(2, "tiny", SamplingParams(max_tokens=5), prompt="untraced"))
    await run_until(svc, lambda: conn.ends(1) and conn.ends(2))
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["queue", "prefill", "decode"]  # request 2 made none
    for s in spans:
        assert s.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
        assert s.parent is not None and s.parent.span_id == 0x00F067AA0BA902B7
    queue, prefill, decode = spans
    assert queue.start_time <= queue.end_time == prefill.start_time <= prefill.end_time == decode.start_time
    assert decode.start_time <= decode.end_time
    assert decode.attributes is not None and decode.attributes["gen_ai.usage.output_tokens"] == 5
    assert not svc.tracer.open  # nothing left behind


def test_a_cancelled_request_ends_its_spans_with_an_error() -> None:
    exporter, svc, conn = traced_service()
    svc.on_cancel(conn, 1)  # before any step: only the queue wait happened
    (queue,) = exporter.get_finished_spans()
    assert queue.name == "queue" and queue.status.status_code is StatusCode.ERROR
    assert not svc.tracer.open


def test_off_by_default_and_opentelemetry_not_imported() -> None:
    code = ("import sys; from inference.worker import build_service, parse_args; "
            "s = build_service(parse_args(['--engine', 'synthetic'])); "
            "print(s.tracer.enabled, any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "False False"
