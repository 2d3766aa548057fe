"""The pipeline's tracing and access log: a span per generation request (the client's trace
continued, traceparent returned and carried to the worker on Submit.trace, first token and status
recorded) and one access-log line per request; neither costs anything while off."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import App
from gateway.http.types import Request
from gateway.observability.logs import ACCESS_LOGGER
from gateway.observability.tracing import RequestTracer, TraceSettings
from gateway.routing.pool import ModelPool

from .doubles import RecordingSink, ScriptedWorkerConnection

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _call(app: App, body: object, headers: list[tuple[bytes, bytes]]) -> RecordingSink:
    sink = RecordingSink()
    done = asyncio.get_running_loop().create_future()
    app.handle(Request("POST", "/v1/chat/completions", "", headers, orjson.dumps(body), "h2", "http",
                       ("10.0.0.7", 5555)), sink, lambda: done.set_result(None))
    await done
    return sink


@pytest.mark.parametrize("stream", [False, True])
async def test_a_span_per_request_continues_the_clients_trace(stream: bool) -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(TraceSettings(enabled=True), exporter=exporter)
    conn = ScriptedWorkerConnection()
    pool = ModelPool()
    pool.add(conn)
    app = App(pool, tracer=tracer)
    s = await _call(app, {**CHAT, "stream": stream}, [(b"traceparent", PARENT.encode())])
    tracer.shutdown()
    assert s.status == 200
    returned = s.header(b"traceparent")
    assert returned is not None and returned.decode().split("-")[1] == PARENT.split("-")[1]  # same trace
    assert conn.submits[0].trace == {"traceparent": returned.decode()}  # the worker's spans join it
    (span,) = exporter.get_finished_spans()
    assert format(span.context.trace_id, "032x") == PARENT.split("-")[1]
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["gen_ai.usage.output_tokens"] == 3
    assert [e.name for e in span.events] == ["first_token"]


async def test_without_tracing_nothing_is_added() -> None:
    conn = ScriptedWorkerConnection()
    pool = ModelPool()
    pool.add(conn)
    s = await _call(App(pool), CHAT, [(b"traceparent", PARENT.encode())])
    assert s.header(b"traceparent") is None and conn.submits[0].trace is None


async def test_one_access_log_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    conn = ScriptedWorkerConnection()
    pool = ModelPool()
    pool.add(conn)
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    app = App(pool, access_log=True)
    await _call(app, CHAT, [])
    await _call(app, {**CHAT, "model": "nope"}, [])
    lines = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert [r.getMessage() for r in lines] == ["POST /v1/chat/completions h2 200", "POST /v1/chat/completions h2 404"]
    fields = lines[0].fields  # type: ignore[attr-defined]
    assert fields["model"] == "tiny" and fields["peer"] == "10.0.0.7" and fields["completion_tokens"] == 3
    caplog.clear()
    await _call(App(pool), CHAT, [])  # off: nothing
    assert not [r for r in caplog.records if r.name == ACCESS_LOGGER]
