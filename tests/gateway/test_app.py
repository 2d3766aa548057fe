"""App + OpenAI handlers against the ScriptedWorkerConnection double (no sockets)."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator

import orjson
import pytest

from gateway.api.config import ApiSettings
from gateway.app import App
from gateway.http.types import Request
from gateway.routing.pool import ModelPool
from transport.errors import ConnectionClosed
from transport.messages import ErrorCode, Stats

from .doubles import RecordingSink, ScriptedWorkerConnection, sse_events
from .over_http import PROTOCOLS, Via, WireResponse

_via = Via("entrance")


@pytest.fixture(autouse=True, params=PROTOCOLS)
async def via(request: pytest.FixtureRequest) -> AsyncIterator[Via]:
    """Every test here runs at the entrance, and over HTTP/1.1 and HTTP/2 listeners (``call``)."""
    global _via
    _via = Via(request.param)
    yield _via
    await _via.close()


def make_app(*conns: ScriptedWorkerConnection, api: ApiSettings | None = None, retries: int = 1) -> App:
    pool = ModelPool(retries=retries)
    for c in conns or (ScriptedWorkerConnection(),):
        pool.add(c)
    return App(pool, api=api)


def req(path: str, body: object = None, method: str = "POST", raw: bytes | None = None) -> Request:
    data = raw if raw is not None else (orjson.dumps(body) if body is not None else b"")
    return Request(method, path, "", [], data, "http/1.1", "http")


async def call(app: App, r: Request, sink: RecordingSink | None = None) -> RecordingSink | WireResponse:
    """One request through the entrance, as an adapter serves it: ``done()`` exactly once, never
    inside ``handle``. Over HTTP/1.1 or HTTP/2 (the ``via`` fixture) when no ``sink`` is given: the
    same request through a real listener and client."""
    if sink is None and _via.protocol != "entrance":
        got = await _via.send(app, r)
        await asyncio.sleep(0)
        assert app.metrics.in_flight == 0
        return got
    sink = sink if sink is not None else RecordingSink()
    ended = asyncio.get_running_loop().create_future()
    calls: list[int] = []

    def done() -> None:
        calls.append(1)
        ended.set_result(None)

    app.handle(r, sink, done)
    assert not calls, "done() must never run inside handle()"
    await ended
    await asyncio.sleep(0)
    assert calls == [1]
    assert app.metrics.in_flight == 0
    return sink


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def test_chat_unary_shape_and_usage() -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    s = await call(app, req("/v1/chat/completions", CHAT))
    assert s.status == 200 and not s.streamed
    assert s.header(b"content-type") == b"application/json"
    body = s.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny"
    # the double emits bytes of "abcdefghij" in order, max_tokens=5 of them
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "abcde", "refusal": None},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == 12
    sub = conn.submits[0]
    assert sub.messages == ({"role": "user", "content": "hi"},) and sub.params.max_tokens == 5
    assert conn.cancels == [] and conn.in_flight == 0


async def test_sampling_params_reach_the_worker() -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    body = {**CHAT, "temperature": 0.3, "top_p": 0.9, "seed": 42, "stop": ["x", "yz"], "user": "u1",
            "max_tokens": None, "max_completion_tokens": 3, "n": 1}
    s = await call(app, req("/v1/chat/completions", body))
    assert s.status == 200, s.body
    p = conn.submits[0].params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (3, 0.3, 0.9, 42, ("x", "yz"))


async def test_default_max_tokens_from_settings() -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn, api=ApiSettings(default_max_tokens=4))
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    s = await call(app, req("/v1/chat/completions", body))
    assert s.json()["choices"][0]["message"]["content"] == "abcd"


@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_stream(include_usage: bool) -> None:
    conn = ScriptedWorkerConnection(tokens_per_batch=2)
    app = make_app(conn)
    body = {**CHAT, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    s = await call(app, req("/v1/chat/completions", body))
    assert s.status == 200 and s.streamed and s.ended
    assert s.header(b"content-type").startswith(b"text/event-stream")
    ev = sse_events(s.body)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "abcde"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert finals[0]["choices"][0]["delta"] == {}
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert all("usage" not in c for c in chunks)


async def test_completions_unary_and_stream() -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    s = await call(app, req("/v1/completions", {"model": "tiny", "prompt": "Say", "max_tokens": 3}))
    b = s.json()
    assert s.status == 200 and b["object"] == "text_completion" and b["choices"][0]["text"] == "abc"
    assert conn.submits[0].prompt == "Say"
    s = await call(app, req("/v1/completions", {"model": "tiny", "prompt": [[1, 2, 3]], "max_tokens": 3,
                                                 "stream": True}))
    ev = sse_events(s.body)
    assert ev[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in ev[:-1]) == "abc"
    assert ev[-2]["choices"][0]["finish_reason"] == "length"
    assert conn.submits[1].prompt_token_ids == (1, 2, 3)


async def test_chat_logprobs() -> None:
    app = make_app(ScriptedWorkerConnection(logprobs_value=-0.25))
    s = await call(app, req("/v1/chat/completions", {**CHAT, "max_tokens": 2, "logprobs": True,
                                                      "top_logprobs": 2}))
    lp = s.json()["choices"][0]["logprobs"]["content"]
    assert [x["token"] for x in lp] == ["a", "b"]
    assert lp[0]["logprob"] == -0.25 and len(lp[0]["top_logprobs"]) == 2
    assert lp[0]["bytes"] == [97]


async def test_completion_logprobs_stream() -> None:
    app = make_app(ScriptedWorkerConnection())
    s = await call(app, req("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "logprobs": 1,
                                                 "stream": True}))
    ev = sse_events(s.body)
    assert ev[0]["choices"][0]["logprobs"]["tokens"] == ["a"]
    assert ev[1]["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]


async def test_models_and_model() -> None:
    app = make_app(ScriptedWorkerConnection(models=("tiny", "other")))
    s = await call(app, req("/v1/models", method="GET"))
    b = s.json()
    assert b["object"] == "list" and [m["id"] for m in b["data"]] == ["other", "tiny"]
    s = await call(app, req("/v1/models/tiny", method="GET"))
    assert s.json()["id"] == "tiny"
    s = await call(app, req("/v1/models/nope", method="GET"))
    assert s.status == 404 and s.json()["error"]["code"] == "model_not_found"


async def test_404_405_health_ready_metrics() -> None:
    app = make_app()
    s = await call(app, req("/nope", method="GET"))
    assert s.status == 404 and s.json()["error"]["code"] == "unknown_url"
    s = await call(app, req("/v1/chat/completions", method="GET"))
    assert s.status == 405 and s.header(b"allow") == b"POST"
    assert s.json()["error"]["type"] == "invalid_request_error"
    assert (await call(app, req("/healthz", method="GET"))).status == 200
    s = await call(app, req("/readyz", method="GET"))
    assert s.status == 200 and s.json()["workers"] == 1
    await call(app, req("/v1/chat/completions", CHAT))
    await call(app, req("/v1/chat/completions", {**CHAT, "stream": True}))  # TTFT: streamed responses
    s = await call(app, req("/metrics", method="GET"))
    text = s.body.decode()
    assert s.status == 200 and s.header(b"content-type").startswith(b"text/plain")
    proto = "http/1.1" if _via.protocol == "entrance" else _via.protocol  # req() says http/1.1
    assert (f'quicserve_requests_total{{model="tiny",protocol="{proto}",route="/v1/chat/completions",status="200"}} 2.0'
            in text)
    assert f'quicserve_requests_total{{model="",protocol="{proto}",route="other",status="404"}} 1.0' in text
    assert "quicserve_time_to_first_token_seconds_count" in text
    assert "quicserve_requests_in_flight 0.0" in text  # small routes are answered at once
    assert 'quicserve_worker_in_flight{worker="scripted"} 0.0' in text


async def test_readyz_without_workers() -> None:
    app = App(ModelPool())
    s = await call(app, req("/readyz", method="GET"))
    assert s.status == 503 and s.json()["status"] == "not ready"


async def test_unknown_model_404() -> None:
    app = make_app()
    s = await call(app, req("/v1/chat/completions", {**CHAT, "model": "gpt-9"}))
    assert s.status == 404
    assert s.json() == {"error": {"message": "The model `gpt-9` does not exist.", "type": "invalid_request_error",
                                  "param": "model", "code": "model_not_found"}}


async def test_worker_error_before_first_token_is_http_error() -> None:
    app = make_app(ScriptedWorkerConnection(fail_before_first=ErrorCode.CONTEXT_LENGTH))
    for stream in (False, True):
        s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": stream}))
        assert s.status == 400 and not s.streamed
        assert s.json()["error"]["code"] == "context_length_exceeded"


async def test_worker_error_mid_stream_is_sse_error_event() -> None:
    app = make_app(ScriptedWorkerConnection(fail_after=2))
    s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": True}))
    ev = sse_events(s.body)
    assert s.status == 200 and s.ended
    assert ev[-1]["error"]["code"] == "internal_error" and "[DONE]" not in ev
    s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": False}))
    assert s.status == 500 and s.json()["error"]["type"] == "server_error"


async def test_retry_on_another_worker_before_first_token() -> None:
    dead = ScriptedWorkerConnection(fail_before_first=ErrorCode.CONNECTION_LOST)
    good = ScriptedWorkerConnection()
    good.latest_stats = Stats(queue_depth=0, running=3, kv_blocks_free=1, kv_blocks_total=1)  # dead looks idler
    app = make_app(dead, good)
    s = await call(app, req("/v1/chat/completions", CHAT))
    assert s.status == 200 and s.json()["choices"][0]["message"]["content"] == "abcde"
    assert len(dead.submits) == 1 and len(good.submits) == 1
    assert app.metrics.retries._value.get() == 1


async def test_no_retry_left_gives_502() -> None:
    app = make_app(ScriptedWorkerConnection(fail_before_first=ErrorCode.CONNECTION_LOST), retries=1)
    s = await call(app, req("/v1/chat/completions", CHAT))
    assert s.status == 502 and s.json()["error"]["code"] == "worker_connection_lost"


@pytest.mark.parametrize(("coding", "status"), [(b"gzip", 415), (b" GZIP ", 415), (b"identity", 400)])
async def test_compressed_body_is_415_not_bad_json(coding: bytes, status: int) -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    r = req("/v1/chat/completions", raw=gzip.compress(orjson.dumps(CHAT)))
    if _via.protocol != "entrance":
        coding = coding.strip()  # on the wire the parser drops the whitespace (and httpx refuses it)
    r = Request(r.method, r.path, r.query, [(b"content-encoding", coding)], r.body, r.protocol, r.scheme)
    s = await call(app, r)
    assert s.status == status and not conn.submits
    err = s.json()["error"]
    assert (err["code"] == "unsupported_content_encoding") == (status == 415)
    assert "uncompressed" in err["message"] if status == 415 else err["code"] == "invalid_utf8"
    assert (await call(app, req("/v1/chat/completions", CHAT))).status == 200  # and it still serves


@pytest.mark.parametrize(("exc", "status", "code", "second_used"), [
    (ConnectionClosed("closed under our feet"), 200, None, True),  # that worker cannot take it: the next one
    (ValueError("seed out of range"), 400, "invalid_value", False),  # no worker could: not a retryable 503
    (RuntimeError("a bug"), 500, "internal_error", False),
], ids=["closed", "wire-rule", "bug"])
async def test_submit_failures_are_told_apart(exc: Exception, status: int, code: str | None,
                                              second_used: bool) -> None:
    first, second = ScriptedWorkerConnection(submit_raises=exc), ScriptedWorkerConnection()
    app = make_app(first, second)
    first._open.add(0)  # busier than the second one only after it failed: it is chosen first
    second._open.update((0, 1))
    s = await call(app, req("/v1/chat/completions", CHAT))
    # (the task-free path declines a request pool.open refuses; the task path then tries it again)
    assert s.status == status and first.submits and bool(second.submits) == second_used
    if code is not None:
        assert s.json()["error"]["code"] == code and s.header(b"retry-after") is None


async def test_all_workers_closed_gives_503() -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    conn.closed = True
    s = await call(app, req("/v1/chat/completions", CHAT))
    assert s.status == 503 and s.header(b"retry-after") == b"1"


async def start(app: App, r: Request, sink: RecordingSink) -> tuple[object, list[int]]:
    """Start a request through the entrance without waiting for its end."""
    done: list[int] = []
    c = app.handle(r, sink, lambda: done.append(1))
    for _ in range(20):
        await asyncio.sleep(0)
    return c, done


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
async def test_client_disconnect_cancels_worker_request_once(stream: bool, logprobs: bool) -> None:
    conn = ScriptedWorkerConnection(hang_after=2)
    app = make_app(conn)
    sink = RecordingSink()
    c, done = await start(app, req("/v1/chat/completions", {**CHAT, "stream": stream, "logprobs": logprobs}), sink)
    assert conn.in_flight == 1 and not done
    assert c.cancel() is True  # what the protocol adapter does when the client goes away
    assert c.cancel() is False
    for _ in range(5):
        await asyncio.sleep(0)
    assert conn.cancels == [1] and done == [1]
    assert app.metrics.in_flight == 0
    assert app.metrics.count("/v1/chat/completions", 499, "http/1.1", "tiny") == 1
    assert not sink.ended  # nothing more is written for a client that left


@pytest.mark.parametrize("logprobs", [False, True])
async def test_stalled_reader_resumes_then_disconnect_cancels(logprobs: bool) -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    body = {**CHAT, "stream": True, "max_tokens": 50, "logprobs": logprobs}
    sink = RecordingSink(block_after_chunks=3)
    c, done = await start(app, req("/v1/chat/completions", body), sink)
    await sink.blocked.wait()
    assert not done
    c.cancel()
    await asyncio.sleep(0)
    assert conn.cancels == [1] and done == [1]
    sink = RecordingSink(block_after_chunks=3)  # a slow reader that comes back gets every token
    c, done = await start(app, req("/v1/chat/completions", body), sink)
    await sink.blocked.wait()
    sink.unblock()
    for _ in range(50):
        await asyncio.sleep(0)
    assert done == [1] and sink.ended
    ev = sse_events(sink.body)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-2])
    assert text == ("abcdefghij" * 5) and ev[-1] == "[DONE]"


async def test_request_timeout_504() -> None:
    app = make_app(ScriptedWorkerConnection(hang_after=0), api=ApiSettings(request_timeout=0.05))
    s = await call(app, req("/v1/chat/completions", CHAT))
    assert s.status == 504 and s.json()["error"]["code"] == "timeout"
    conn = ScriptedWorkerConnection(hang_after=2)
    app = make_app(conn, api=ApiSettings(request_timeout=0.05))
    s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": True}))
    assert s.status == 200 and sse_events(s.body)[-1]["error"]["code"] == "timeout"
    assert conn.cancels == [1]


async def test_timeout_of_a_client_that_stopped_reading_aborts() -> None:
    conn = ScriptedWorkerConnection(hang_after=10)
    app = make_app(conn, api=ApiSettings(request_timeout=0.05))
    sink = RecordingSink(block_after_chunks=2)
    s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 50}), sink)
    assert s.aborted and not s.ended and conn.cancels == [1]
    assert app.metrics.count("/v1/chat/completions", 504, "http/1.1", "tiny") == 1


async def test_whole_responses_are_buffered_by_the_worker() -> None:
    conn = ScriptedWorkerConnection()
    app = make_app(conn)
    for body in ({**CHAT, "stream": True}, {**CHAT, "logprobs": True}, CHAT):
        assert (await call(app, req("/v1/chat/completions", body))).status == 200
    assert [s.buffered for s in conn.submits] == [False, False, True]


async def test_readyz_says_why_no_worker_will_come() -> None:
    app = App(ModelPool())
    app.worker_failure = lambda: "worker-0 exited with status 2 before it was ready: --max-batch: must be >= 1"
    s = await call(app, req("/readyz", method="GET"))
    assert s.status == 503 and s.json()["reason"].startswith("worker-0 exited with status 2")
    app.draining = True
    assert (await call(app, req("/readyz", method="GET"))).json()["reason"] == "draining"


async def test_draining_refuses_new_generations_and_cuts_open_ones_explicitly() -> None:
    conn = ScriptedWorkerConnection(hang_after=2)
    app = make_app(conn)
    open_sinks = [RecordingSink() for _ in range(3)]
    ended: list[int] = []
    for i, (sink, body) in enumerate(zip(open_sinks, [{**CHAT, "stream": True}, CHAT, {**CHAT, "stream": True,
                                                                                       "logprobs": True}],
                                         strict=True)):
        app.handle(req("/v1/chat/completions", body), sink, lambda i=i: ended.append(i))
    for _ in range(10):
        await asyncio.sleep(0)
    app.draining = True
    s, h = RecordingSink(), RecordingSink()
    app.handle(req("/v1/chat/completions", CHAT), s, lambda: None)
    app.handle(req("/healthz", method="GET"), h, lambda: None)
    assert s.status == 503 and s.json()["error"]["code"] == "shutting_down"
    assert s.header(b"retry-after") == b"1" and s.header(b"connection") == b"close"
    assert h.status == 200  # the small routes still answer
    assert app.metrics.in_flight == 3
    assert app.end_all() == 3
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(ended) == [0, 1, 2] and app.metrics.in_flight == 0
    stream, whole, lp = open_sinks
    assert sse_events(stream.body)[-1]["error"]["code"] == "shutting_down" and stream.ended
    assert sse_events(lp.body)[-1]["error"]["code"] == "shutting_down" and lp.ended
    assert whole.status == 503 and whole.json()["error"]["code"] == "shutting_down"
    assert sorted(conn.cancels) == [1, 2, 3]
    assert app.metrics.drain_cut._value.get() == 3


async def test_a_client_that_reads_nothing_is_cut_off_after_the_write_timeout() -> None:
    conn = ScriptedWorkerConnection(hang_after=20)
    app = make_app(conn, api=ApiSettings(write_timeout=0.05))
    sink = RecordingSink(block_after_chunks=2)
    s = await call(app, req("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 50}), sink)
    assert s.aborted and conn.cancels == [1]
    assert app.metrics.count("/v1/chat/completions", 408, "http/1.1", "tiny") == 1
