"""Adversarial input at the front door, over real sockets on 127.0.0.1: the app behind the
real HTTP/1.1 and h2c listeners with the ScriptedWorkerConnection double for a worker (and,
where the Submit's encoding matters, a real transport connection to the EchoWorker double).

What a user would notice: every bad request gets the OpenAI error JSON with the right
status and the connection (or the server) keeps serving; pipelined responses come back
in order and whole; a client that goes away has its worker request cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import orjson
import pytest

from gateway.app import App
from gateway.http.server import HttpLimits, start_server
from gateway.routing.pool import ModelPool
from tests.gateway.http.conftest import error_of
from tests.gateway.http.test_h1_bytes import parse_responses
from tests.integration.app_gateway import AppGateway, app_gateway
from tests.transport.doubles import EchoWorker
from tests.waiting import wait_for
from transport.client import connect
from transport.messages import Finish, FinishReason
from transport.server import serve

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
LIMITS = HttpLimits(max_body_bytes=1 << 16, max_header_bytes=4096, linger_timeout=0.3)


@pytest.fixture
async def gw() -> AsyncIterator[AppGateway]:
    async with app_gateway(limits=LIMITS) as g:
        yield g


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), extra, body))


def chat(**patch: Any) -> bytes:
    return post("/v1/chat/completions", orjson.dumps({**CHAT, **patch}))


GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


async def exchange(gw: AppGateway, pieces: list[bytes], until: int, methods: list[str],
                   timeout: float = 3.0) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Send ``pieces`` (each its own write), read until ``until`` responses are complete."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    try:
        for p in pieces:
            writer.write(p)
            if len(pieces) > 1:
                await writer.drain()
        buf = b""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while len(res := parse_responses(buf, methods) if buf else []) < until:
            chunk = await asyncio.wait_for(reader.read(65536), end - loop.time())
            if not chunk:
                break
            buf += chunk
        return res
    finally:
        writer.close()


async def still_serves(gw: AppGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "abcdef"


# -- HTTP/1.1 pipelining ---------------------------------------------------------------------

MIXED = [
    chat(),
    chat(stream=True, max_tokens=3),
    post("/v1/chat/completions", b"{not json"),
    GET_MODELS,
    post("/v1/completions", orjson.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2})),
]


@pytest.mark.parametrize("mode", ["one-write", "bytewise"])
async def test_pipelined_mixed_requests_in_order(gw: AppGateway, mode: str) -> None:
    data = b"".join(MIXED)
    pieces = [data] if mode == "one-write" else [data[i:i + 1] for i in range(len(data))]
    res = await exchange(gw, [*pieces, GET_MODELS], 6, ["POST", "POST", "POST", "GET", "POST", "GET"])
    assert [r[0] for r in res] == [200, 200, 400, 200, 200, 200]
    assert orjson.loads(res[0][2])["choices"][0]["message"]["content"] == "abcdef"
    assert res[1][1][b"transfer-encoding"] == b"chunked" and res[1][2].endswith(b"data: [DONE]\n\n")
    assert res[1][2].count(b"chat.completion.chunk") == 5  # role, 3 tokens, finish
    assert error_of(res[2][2])["code"] == "invalid_json"
    assert orjson.loads(res[3][2])["data"][0]["id"] == "tiny"
    assert orjson.loads(res[4][2])["choices"][0]["text"] == "ab"
    assert orjson.loads(res[5][2])["object"] == "list"  # the connection is still usable
    assert gw.conn.cancels == [] and gw.conn.in_flight == 0


# -- client going away ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_client_closing_after_a_request_cancels_it_on_the_worker(gw: AppGateway, stream: bool) -> None:
    gw.conn.hang_after = 1
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(chat(stream=stream))
    await wait_for(lambda: gw.conn.submits)
    writer.close()
    await wait_for(lambda: gw.conn.cancels == [1])
    await wait_for(lambda: gw.server.in_flight == 0 and gw.app.metrics.in_flight == 0)
    gw.conn.hang_after = None
    await still_serves(gw)


async def test_client_closing_with_pipelined_requests_cancels_only_the_running_one(gw: AppGateway) -> None:
    gw.conn.hang_after = 1
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(chat() + chat() + chat(stream=True))
    await wait_for(lambda: gw.conn.submits)
    writer.close()
    await wait_for(lambda: gw.conn.cancels == [1])
    await wait_for(lambda: gw.server.in_flight == 0)
    assert len(gw.conn.submits) == 1  # the queued ones never reached a worker


async def test_client_leaving_a_full_pipeline_cancels_the_running_request(gw: AppGateway) -> None:
    """More pipelined requests than ``max_pipelined`` at once: the server still notices the close."""
    gw.conn.hang_after = 1
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(chat() * (LIMITS.max_pipelined + 24))
    await wait_for(lambda: gw.conn.submits)
    writer.close()
    await wait_for(lambda: gw.conn.cancels == [1])
    await wait_for(lambda: gw.server.in_flight == 0)
    assert len(gw.conn.submits) == 1


async def test_client_leaving_past_the_held_input_limit_cancels_the_running_request(gw: AppGateway) -> None:
    """Pipelined input past ``max_pipelined`` waiting requests and then past 64 KiB held: reading
    pauses, yet the close is still seen and the running request cancelled; nothing queued runs."""
    gw.conn.hang_after = 1
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(chat() * (LIMITS.max_pipelined + 1))
    await wait_for(lambda: gw.conn.submits)
    for _ in range((80 << 10) // (8 * len(chat()))):  # reads the server holds, one after another
        writer.write(chat() * 8)
        await writer.drain()
        await asyncio.sleep(0.001)
    writer.close()
    await wait_for(lambda: gw.conn.cancels == [1], timeout=3.0)
    await wait_for(lambda: gw.server.in_flight == 0)
    assert len(gw.conn.submits) == 1
    gw.conn.hang_after = None
    await still_serves(gw)


async def test_pipelining_past_the_held_input_limit_loses_nothing(gw: AppGateway) -> None:
    """The client that stays: every request held behind the paused read is answered, in order."""
    gw.conn.hang_after = 1
    n = (80 << 10) // len(GET_MODELS) + LIMITS.max_pipelined
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    try:
        writer.write(chat())
        await wait_for(lambda: gw.conn.submits)
        for i in range(0, n, 64):  # separate reads, so the server holds them and then pauses
            writer.write(GET_MODELS * min(64, n - i))
            await writer.drain()
            await asyncio.sleep(0.001)
        gw.conn.streams[1].put([Finish(1, FinishReason.LENGTH, 7, 1)])
        buf = bytearray()
        while buf.count(b"HTTP/1.1 ") < 1 + n:  # (parsing once, at the end: h11 per read is quadratic)
            chunk = await asyncio.wait_for(reader.read(1 << 20), 5)
            assert chunk, f"closed after {buf.count(b'HTTP/1.1 ')} responses"
            buf += chunk
    finally:
        writer.close()
    res = parse_responses(bytes(buf), ["POST"] + ["GET"] * n)
    assert [r[0] for r in res] == [200] * (1 + n) and orjson.loads(res[0][2])["choices"][0]["message"]["content"] == "a"
    assert all(orjson.loads(r[2])["object"] == "list" for r in res[1:])


async def test_half_close_after_a_request_counts_as_gone(gw: AppGateway) -> None:
    """A client that shuts its write side is treated as gone (as Go's net/http and nginx do):
    its request is cancelled on the worker."""
    gw.conn.hang_after = 1
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(chat())
    await wait_for(lambda: gw.conn.submits)
    writer.write_eof()
    await wait_for(lambda: gw.conn.cancels == [1])
    assert await asyncio.wait_for(reader.read(), 2) == b""
    writer.close()


async def test_http10_requests(gw: AppGateway) -> None:
    """HTTP/1.0: a whole response has its length; a stream's body ends at close (no chunked)."""
    raw = chat().replace(b"HTTP/1.1", b"HTTP/1.0")
    res = await exchange(gw, [raw], 1, ["POST"])
    assert res[0][0] == 200 and orjson.loads(res[0][2])["choices"][0]["message"]["content"] == "abcdef"
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(chat(stream=True, max_tokens=3).replace(b"HTTP/1.1", b"HTTP/1.0"))
    data = await asyncio.wait_for(reader.read(), 2)  # until the server closes
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower()
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"chat.completion.chunk") == 5


async def test_connection_close_ends_the_pipeline(gw: AppGateway) -> None:
    raw = chat().replace(b"Host: x\r\n", b"Host: x\r\nconnection: close\r\n") + chat()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(raw)
    data = await asyncio.wait_for(reader.read(), 2)
    writer.close()
    res = parse_responses(data, ["POST", "POST"])
    assert [r[0] for r in res] == [200] and res[0][1][b"connection"] == b"close"
    assert len(gw.conn.submits) == 1  # what came after "close" was not run


@pytest.mark.parametrize("extra, status", [(0, 200), (1, 413)])
async def test_body_at_the_limit(gw: AppGateway, extra: int, status: int) -> None:
    body = orjson.dumps(CHAT)
    body = body[:-1] + b" " * (LIMITS.max_body_bytes - len(body) + extra) + b"}"
    res = await exchange(gw, [post("/v1/chat/completions", body)], 1, ["POST"])
    assert res[0][0] == status
    if status != 200:
        error_of(res[0][2])
    await still_serves(gw)


# -- HTTP/1.1 framing ----------------------------------------------------------------------------

BODY = orjson.dumps(CHAT)


async def test_chunked_body_with_extensions_and_trailers(gw: AppGateway) -> None:
    a, b = BODY[:10], BODY[10:]
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
           b"transfer-encoding: chunked\r\n\r\n"
           b"%x;name=value\r\n%s\r\n%x\r\n%s\r\n0\r\nx-trailer: t\r\n\r\n" % (len(a), a, len(b), b))
    res = await exchange(gw, [raw, GET_MODELS], 2, ["POST", "GET"])
    assert [r[0] for r in res] == [200, 200]
    assert orjson.loads(res[0][2])["choices"][0]["message"]["content"] == "abcdef"


async def test_expect_100_continue_on_chat(gw: AppGateway) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nexpect: 100-continue\r\n"
                     b"content-length: %d\r\n\r\n" % len(BODY))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(BODY)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert head.startswith(b"HTTP/1.1 200 ")
    finally:
        writer.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\nhello",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n"
        b"\r\n3\r\nabc\r\n0\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ntransfer-encoding: gzip\r\n\r\nabc",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: -1\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: +5\r\n\r\nhello",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 99999999999999999999999\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost : x\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\nHost: x\n\n",
        b"POST /v1/chat/completions HTTP/2.0\r\nHost: x\r\n\r\n",
        b"POST /v1/chat/completions\r\n\r\n",
    ],
    ids=["two-cl", "dup-cl", "te-and-cl", "te-not-chunked", "negative-cl", "plus-cl", "huge-cl", "space-before-colon",
         "obs-fold", "bare-lf", "http2-version", "http09"],
)
async def test_smuggling_shapes_get_an_error_and_the_server_lives(gw: AppGateway, raw: bytes) -> None:
    res = await exchange(gw, [raw + chat()], 1, ["POST", "POST"])
    assert res, "no response"
    status, headers, body = res[0]
    assert status in (400, 413) and headers[b"connection"] == b"close", (status, body)
    error_of(body)
    assert len(res) == 1 and not gw.conn.submits  # nothing after the bad message was run
    await still_serves(gw)


@pytest.mark.parametrize(
    "raw, status, code",
    [
        (chat().replace(b"Host: x\r\n", b""), 400, "invalid_request"),
        (chat().replace(b"Host: x\r\n", b"Host: x\r\nHost: y\r\n"), 400, "invalid_request"),
        (chat().replace(b"Host: x\r\n", b"Host: x y\r\n"), 400, "invalid_request"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
         b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY), 501, "unsupported_transfer_encoding"),
    ],
    ids=["no-host", "two-hosts", "bad-host", "gzip-chunked"],
)
async def test_host_and_transfer_coding_errors_over_a_socket(gw: AppGateway, raw: bytes, status: int,
                                                              code: str | None) -> None:
    """RFC 9112 3.2 and 6.1: the error JSON, the connection closed (nothing after it runs), the
    server serving the next client."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(raw + chat())
    data = await asyncio.wait_for(reader.read(), 2)  # until the server closes
    writer.close()
    res = parse_responses(data, ["POST", "POST"])
    assert [(r[0], r[1][b"connection"]) for r in res] == [(status, b"close")]
    assert error_of(res[0][2])["code"] == code and not gw.conn.submits
    assert gw.app.metrics.protocol_errors.labels(str(status), "http/1.1")._value.get() == 1
    await still_serves(gw)


async def test_http10_without_host_is_served(gw: AppGateway) -> None:
    raw = chat().replace(b"HTTP/1.1", b"HTTP/1.0").replace(b"Host: x\r\n", b"")
    res = await exchange(gw, [raw], 1, ["POST"])
    assert res[0][0] == 200 and orjson.loads(res[0][2])["choices"][0]["message"]["content"] == "abcdef"


async def test_many_small_headers(gw: AppGateway) -> None:
    few = b"".join(b"x-%d: v\r\n" % i for i in range(100))
    many = b"".join(b"x-%d: v\r\n" % i for i in range(2000))
    res = await exchange(gw, [chat().replace(b"Host: x\r\n", b"Host: x\r\n" + few)], 1, ["POST"])
    assert res[0][0] == 200
    res = await exchange(gw, [chat().replace(b"Host: x\r\n", b"Host: x\r\n" + many)], 1, ["POST"])
    assert res[0][0] == 431 and error_of(res[0][2])["type"] == "invalid_request_error"
    await still_serves(gw)


@pytest.mark.parametrize(
    "target, status",
    [
        (b"http://example.com/v1/chat/completions", 200),
        (b"/v1/chat/%63ompletions", 200),
        (b"/v1/chat/completions?x=1", 200),
        (b"/v1/chat/completions/", 404),
        (b"//v1/chat/completions", 404),
        (b"/v1/chat/completions%00", 404),
        (b"/v1/chat/completions%2", 404),
        (b"*", 404),
    ],
)
async def test_request_targets(gw: AppGateway, target: bytes, status: int) -> None:
    raw = chat().replace(b"/v1/chat/completions", target, 1)
    res = await exchange(gw, [raw, GET_MODELS], 2, ["POST", "GET"])
    assert [r[0] for r in res] == [status, 200], res
    if status != 200:
        assert error_of(res[0][2])["code"] == "unknown_url"


@pytest.mark.parametrize("method, status", [(b"HEAD", 405), (b"OPTIONS", 405), (b"GET", 405), (b"PATCH", 405)])
async def test_other_methods_on_the_chat_route(gw: AppGateway, method: bytes, status: int) -> None:
    raw = chat().replace(b"POST", method, 1)
    res = await exchange(gw, [raw, GET_MODELS], 2, [method.decode(), "GET"])
    assert [r[0] for r in res] == [status, 200], res
    assert res[0][1][b"allow"] == b"POST"
    if method != b"HEAD":
        assert error_of(res[0][2])["code"] == "method_not_allowed"
    else:
        assert res[0][2] == b"" and int(res[0][1][b"content-length"]) > 0


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/v1/models", "/v1/models/tiny", "/metrics"])
@pytest.mark.parametrize("h2", [False, True])
async def test_head_on_get_routes(gw: AppGateway, path: str, h2: bool) -> None:
    """RFC 9110 9.1: a server supports HEAD wherever it supports GET (load balancers probe with it)."""
    async with httpx.AsyncClient(base_url=gw.url, http1=not h2, http2=h2) as c:
        get = await c.get(path)
        head = await c.head(path)
    assert get.status_code == head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    if path != "/metrics":  # the metrics page changes between the two requests
        assert head.headers["content-length"] == str(len(get.content))


# -- JSON bodies --------------------------------------------------------------------------------

BIG = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], %s}'
BAD_BODIES = [
    (b"[" * 5000 + b"]" * 5000, "invalid_json"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "invalid_json"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', "invalid_json"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}', "invalid_json"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_json"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00\\ud800"}]}', "invalid_json"),
    (b'[{"model": "tiny"}]', "invalid_json"),
    (b'"hello"', "invalid_json"),
    (b"null", "invalid_json"),
    (b"", "invalid_json"),
    (b"\xef\xbb\xbf" + orjson.dumps(CHAT), "invalid_json"),
    (orjson.dumps({**CHAT, "max_tokens": True}), "invalid_type"),
    (BIG % b'"max_tokens": 1000000000000000000000000000000', "invalid_type"),  # a float to JSON parsers
    (BIG % b'"max_tokens": 18446744073709551615', "invalid_value"),
    (BIG % b'"max_tokens": -9223372036854775808', "invalid_value"),
    (orjson.dumps({**CHAT, "temperature": 1e300}), "invalid_value"),
    (orjson.dumps({**CHAT, "n": 1.0}), "invalid_type"),
    (BIG % b'"seed": 100000000000000000000000', "invalid_value"),  # the schema: above the int64 maximum
    (orjson.dumps({**CHAT, "stop": ["a", "b", "c", "d", "e"]}), "invalid_value"),
    (orjson.dumps({**CHAT, "stop": [1]}), "invalid_value"),  # the schema's anyOf (string | array of strings)
    (orjson.dumps({**CHAT, "stream_options": {"include_usage": True}}), "invalid_value"),
    (orjson.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
     "invalid_value"),
    (orjson.dumps({**CHAT, "messages": [{"role": "user", "content": None}]}), "invalid_value"),  # anyOf
    (orjson.dumps({**CHAT, "messages": [{"role": "user"}]}), "missing_required_parameter"),
    (orjson.dumps({**CHAT, "messages": [{"content": "x"}]}), "missing_required_parameter"),
    (orjson.dumps({**CHAT, "model": ["tiny"]}), "invalid_type"),
    (orjson.dumps({**CHAT, "model": ""}), "invalid_value"),  # the schema's minLength
]


@pytest.mark.parametrize("body, code", BAD_BODIES, ids=[f"b{i}" for i in range(len(BAD_BODIES))])
async def test_bad_json_bodies_get_a_400_and_the_connection_lives(gw: AppGateway, body: bytes, code: str) -> None:
    res = await exchange(gw, [post("/v1/chat/completions", body), GET_MODELS], 2, ["POST", "GET"])
    assert [r[0] for r in res] == [404 if code == "model_not_found" else 400, 200], res
    err = error_of(res[0][2])
    assert err["code"] == code, err
    assert not gw.conn.submits


GOOD_BODIES = [
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]},
     "hi"),
    ({**CHAT, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "\u00e9\U0001f600\u0000"}]},
     "s|\u00e9\U0001f600\u0000"),
    ({**CHAT, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None},
                           {"role": "user", "content": "y", "name": "bob"}]}, "x||y"),
    ({**CHAT, "stop": ["", "", ""]}, "hi"),
    ({**CHAT, "max_tokens": None}, "hi"),
    ({**CHAT, "n": 1, "temperature": 0, "top_p": 1e-9}, "hi"),
]


@pytest.mark.parametrize("body, text", GOOD_BODIES, ids=[f"g{i}" for i in range(len(GOOD_BODIES))])
async def test_unusual_but_valid_bodies_are_served(gw: AppGateway, body: dict[str, Any], text: str) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert "|".join(m["content"] for m in gw.conn.submits[0].messages) == text


async def test_duplicate_keys_last_wins_and_escaped_surrogate_pairs_decode(gw: AppGateway) -> None:
    raw = (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 100, '
           b'"max_tokens": 2}')
    res = await exchange(gw, [post("/v1/chat/completions", raw)], 1, ["POST"])
    assert res[0][0] == 200 and orjson.loads(res[0][2])["choices"][0]["message"]["content"] == "ab"
    assert gw.conn.submits[0].messages[0]["content"] == "\U0001f600"


# -- HTTP/2 --------------------------------------------------------------------------------------


class H2Client:
    """A raw h2 client over a real socket (so a test can reset streams and size windows)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, window: int | None) -> None:
        self.r, self.w = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        if window is not None:
            self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.events: dict[int, list[Any]] = {}
        self.flush()

    @classmethod
    async def open(cls, gw: AppGateway, window: int | None = None) -> H2Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
        return cls(reader, writer, window)

    def flush(self) -> None:
        self.w.write(self.h2.data_to_send())

    def request(self, body: bytes, path: str = "/v1/chat/completions") -> int:
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, [(":method", "POST"), (":path", path), (":scheme", "http"),
                                   (":authority", "x"), ("content-type", "application/json")])
        self.events[sid] = []
        self.flush()
        return sid

    async def send_body(self, sid: int, body: bytes, end: bool = True) -> None:
        view = memoryview(body)
        while view:
            n = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size, len(view))
            if n == 0:
                await self.pump()
                continue
            self.h2.send_data(sid, view[:n].tobytes(), end_stream=end and n == len(view))
            view = view[n:]
            self.flush()

    async def pump(self) -> None:
        data = await asyncio.wait_for(self.r.read(65536), 3)
        assert data, "connection closed"
        for ev in self.h2.receive_data(data):
            sid = getattr(ev, "stream_id", 0)
            if isinstance(ev, h2.events.DataReceived):
                self.h2.acknowledge_received_data(ev.flow_controlled_length, sid)
            if sid:
                self.events.setdefault(sid, []).append(ev)
        self.flush()

    def ended(self, sid: int) -> bool:
        return any(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) for e in self.events[sid])

    def status(self, sid: int) -> int:
        ev = next(e for e in self.events[sid] if isinstance(e, h2.events.ResponseReceived))
        return int(dict(ev.headers)[b":status"])

    def body_of(self, sid: int) -> bytes:
        return b"".join(e.data for e in self.events[sid] if isinstance(e, h2.events.DataReceived))

    async def close(self) -> None:
        self.w.close()
        with contextlib.suppress(Exception):
            await self.w.wait_closed()


@pytest.mark.parametrize("stream", [False, True])
async def test_h2_rst_stream_mid_request_cancels_on_the_worker(gw: AppGateway, stream: bool) -> None:
    gw.conn.hang_after = 2
    c = await H2Client.open(gw)
    try:
        sid = c.request(b"")
        await c.send_body(sid, orjson.dumps({**CHAT, "stream": stream}))
        if stream:
            while b'"content":"b"' not in c.body_of(sid):
                await c.pump()
        else:
            await wait_for(lambda: gw.conn.submits)
        c.h2.reset_stream(sid)
        c.flush()
        await wait_for(lambda: gw.conn.cancels == [1])
        await wait_for(lambda: gw.server.in_flight == 0)
        gw.conn.hang_after = None
        sid2 = c.request(b"")
        await c.send_body(sid2, orjson.dumps(CHAT))  # the connection still serves
        while not c.ended(sid2):
            await c.pump()
        assert c.status(sid2) == 200
    finally:
        await c.close()


async def test_httpx_h2_leaving_cancels_every_stream_on_the_worker(gw: AppGateway) -> None:
    """httpx over h2 sends no RST_STREAM when a response is abandoned; when the client goes, its
    connection's close is what ends the streams: each one's worker request is cancelled."""
    gw.conn.hang_after = 1
    client = httpx.AsyncClient(base_url=gw.url, http1=False, http2=True)
    def chat_request(stream: bool) -> httpx.Request:
        return client.build_request("POST", "/v1/chat/completions", json={**CHAT, "stream": stream})

    streams = [await client.send(chat_request(True), stream=True) for _ in range(2)]
    whole = asyncio.ensure_future(client.send(chat_request(False)))  # waits for its whole body
    for r in streams:
        assert r.http_version == "HTTP/2" and r.status_code == 200
        assert b"chat.completion.chunk" in await r.aiter_bytes().__anext__()
    await wait_for(lambda: len(gw.conn.submits) == 3)
    assert gw.conn.cancels == []
    await client.aclose()
    with contextlib.suppress(httpx.HTTPError, asyncio.CancelledError):
        await asyncio.wait_for(whole, 2)
    await wait_for(lambda: sorted(gw.conn.cancels) == [1, 2, 3])
    await wait_for(lambda: gw.server.in_flight == 0 and gw.conn.in_flight == 0)


async def test_h2_many_streams_one_bad(gw: AppGateway) -> None:
    c = await H2Client.open(gw)
    try:
        sids = []
        for i in range(20):
            sid = c.request(b"")
            await c.send_body(sid, b"{oops" if i == 7 else orjson.dumps({**CHAT, "stream": i % 2 == 0}))
            sids.append(sid)
        while not all(c.ended(s) for s in sids):
            await c.pump()
        statuses = [c.status(s) for s in sids]
        assert statuses == [400 if i == 7 else 200 for i in range(20)]
        assert error_of(c.body_of(sids[7]))["code"] == "invalid_json"
        assert all(c.body_of(s).endswith(b"data: [DONE]\n\n") for i, s in enumerate(sids) if i % 2 == 0 and i != 7)
    finally:
        await c.close()


async def test_h2_request_body_larger_than_the_window(gw: AppGateway) -> None:
    """A 300 KB body over a stream (and connection) whose 64 KiB receive window the server must
    reopen as it reads; a second stream's whole request comes in the middle of it."""
    limits = HttpLimits(max_body_bytes=1 << 20, h2_initial_window_size=65535)
    server = await start_server(gw.app.handle, host="127.0.0.1", port=0, limits=limits)
    big = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 300_000}]})
    c = await H2Client.open(AppGateway(gw.app, gw.conn, server, None))
    try:
        a, b = c.request(b""), c.request(b"")
        await c.send_body(a, big[:70_000], end=False)  # past the 64 KiB windows: waits for WINDOW_UPDATE
        await c.send_body(b, orjson.dumps(CHAT))
        await c.send_body(a, big[70_000:])
        while not (c.ended(a) and c.ended(b)):
            await c.pump()
        assert c.status(a) == c.status(b) == 200
        assert sorted(len(s.messages[0]["content"]) for s in gw.conn.submits) == [2, 300_000]
    finally:
        await c.close()
        await server.close()


async def test_h2_streams_past_the_concurrency_limit_are_refused_not_the_connection(gw: AppGateway) -> None:
    """A client that opens more streams than MAX_CONCURRENT_STREAMS before it has read our SETTINGS
    gets REFUSED_STREAM on the extra ones (RFC 9113 5.1.2: a stream error, safe to retry); the
    streams within the limit run and the connection lives."""
    gw.conn.hang_after = 0  # nothing finishes: exactly the limit is open at once
    limit = LIMITS.h2_max_concurrent_streams
    c = await H2Client.open(gw)
    try:
        sids = []
        for _ in range(limit + 20):
            sid = c.h2.get_next_available_stream_id()
            c.events[sid] = []
            c.h2.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
                                    (":authority", "x")])
            c.h2.send_data(sid, orjson.dumps(CHAT), end_stream=True)
            sids.append(sid)
        c.flush()
        while not all(c.ended(s) for s in sids[limit:]):
            await c.pump()
        assert all(isinstance(c.events[s][-1], h2.events.StreamReset) and c.events[s][-1].error_code == 7
                   for s in sids[limit:])  # REFUSED_STREAM
        await wait_for(lambda: len(gw.conn.submits) == limit)
        assert not any(c.events[s] for s in sids[:limit])
        gw.conn.hang_after = None
        c.h2.reset_stream(sids[0])
        sid = c.request(b"")
        await c.send_body(sid, orjson.dumps(CHAT))
        while not c.ended(sid):
            await c.pump()
        assert c.status(sid) == 200
    finally:
        await c.close()
    await wait_for(lambda: len(gw.conn.cancels) == limit)


@pytest.mark.parametrize(
    "headers, body",
    [
        ([("connection", "keep-alive")], None),
        ([("te", "gzip")], None),
        ([("X-Upper", "1")], None),
        ([("x-space", " padded ")], None),
        ([("content-length", "abc")], None),
        ([("content-length", "3")], None),  # the body is longer
        ([("content-length", "500")], None),  # the body is shorter
        ([(":foo", "b")], None),
        ([("x", "1"), (":scheme", "http")], None),  # a pseudo-header after a regular one
        ([], b""),  # no body and END_STREAM on HEADERS: :path missing below
        ([(":authority", None)], None),  # and no host either (RFC 9113 8.3.1, RFC 9110 7.2)
        ([("host", "x"), ("host", "x")], None),
        ([("host", "y")], None),  # differs from :authority
        ([(":authority", "x y")], None),
        ([(":authority", None), ("host", "user@x")], None),
    ],
    ids=["connection", "te", "uppercase", "whitespace", "cl-not-a-number", "cl-short", "cl-long", "unknown-pseudo",
         "pseudo-after-regular", "no-path", "no-authority-no-host", "two-hosts", "host-not-authority",
         "authority-space", "host-userinfo"],
)
async def test_h2_malformed_request_is_a_400_on_its_stream_not_the_connection(
        gw: AppGateway, headers: list[tuple[str, str | None]], body: bytes | None) -> None:
    """RFC 9113 8.1.1: a malformed request is a stream error. Its neighbours on the connection
    keep running (h2 itself would tear the connection down, cancelling them)."""
    gw.conn.hang_after = 1
    c = await H2Client.open(gw)
    c.h2.config.validate_outbound_headers = c.h2.config.normalize_outbound_headers = False
    try:
        running = c.request(b"")
        await c.send_body(running, orjson.dumps({**CHAT, "stream": True}))
        while not c.body_of(running):
            await c.pump()
        sid = c.h2.get_next_available_stream_id()
        c.events[sid] = []
        base = [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"), (":authority", "x")]
        if body is not None:
            base = [h for h in base if h[0] != ":path"]
        base = [h for h in base if h[0] not in {k for k, _ in headers if k.startswith(":")}]
        c.h2.send_headers(sid, [h for h in base + headers if h[1] is not None], end_stream=body is not None)
        if body is None:  # in two DATA frames: a length error may show on each
            c.h2.send_data(sid, orjson.dumps(CHAT))
            c.h2.send_data(sid, b" ", end_stream=True)
        c.flush()
        while not c.ended(sid):
            await c.pump()
        assert c.status(sid) == 400
        assert gw.app.metrics.protocol_errors.labels("400", "h2")._value.get() == 1  # answered once
        assert "malformed request" in error_of(c.body_of(sid))["message"]
        assert not c.ended(running) and gw.conn.cancels == []
        gw.conn.hang_after = None
        sid = c.request(b"")
        await c.send_body(sid, orjson.dumps(CHAT))
        while not c.ended(sid):
            await c.pump()
        assert c.status(sid) == 200  # the connection still serves
    finally:
        await c.close()
    await wait_for(lambda: gw.conn.cancels == [1])  # the running stream ended with the connection


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("kind", ["app-400", "adapter-413"])
async def test_h2_error_response_larger_than_the_peer_window(gw: AppGateway, window: int, kind: str) -> None:
    """An error body that does not fit the client's stream window still arrives whole once the
    client opens the window (not cut to headers that promise a body that never comes)."""
    c = await H2Client.open(gw, window=window)
    try:
        for _ in range(3):  # let the SETTINGS exchange finish
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.pump(), 0.05)
        sid = c.h2.get_next_available_stream_id()
        c.events[sid] = []
        big = kind == "adapter-413"
        c.h2.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
                                (":authority", "x"), ("content-length", str(LIMITS.max_body_bytes + 1 if big else 5))])
        c.h2.send_data(sid, b"{oops", end_stream=not big)
        c.flush()
        for _ in range(3):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.pump(), 0.05)
        c.h2.increment_flow_control_window(4096, sid)
        c.flush()
        while not c.ended(sid):
            await c.pump()
        assert c.status(sid) == (413 if big else 400)
        assert error_of(c.body_of(sid))["type"] == "invalid_request_error"
    finally:
        await c.close()


# -- over the real transport (EchoWorker double, loopback) -------------------------------------


@pytest.fixture
async def real() -> AsyncIterator[AppGateway]:
    """The app over a real transport connection to an EchoWorker: Submits are encoded on the wire."""
    worker = EchoWorker(step_delay=0.001)
    srv = await serve("tcp://127.0.0.1:0", worker)
    conn = await connect(srv.address)
    pool = ModelPool()
    pool.add(conn)
    app = App(pool)
    server = await start_server(app.handle, host="127.0.0.1", port=0, limits=LIMITS, on_event=app.on_http_event)
    yield AppGateway(app, conn, server, None)  # type: ignore[arg-type]
    await server.close()
    await conn.close()
    await srv.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", [[2**32], [1, 2**40], [[2**32]]])
async def test_token_ids_past_32_bits_are_a_400_not_a_503(real: AppGateway, prompt: list[Any], stream: bool) -> None:
    async with httpx.AsyncClient(base_url=real.url) as c:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                  "stream": stream})
        assert r.status_code == 400, r.text
        err = error_of(r.content)
        assert err["param"] == "prompt" and err["type"] == "invalid_request_error"
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": [2**32 - 1], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t0t1"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value", [("seed", 2**64 - 1), ("seed", 2**63), ("top_k", 2**63)])
async def test_64_bit_values_the_wire_cannot_carry_are_a_400_and_the_worker_stays(
        real: AppGateway, field: str, value: int, stream: bool) -> None:
    """The gateway may accept only what the worker's decoder accepts: a Submit it rejects is a
    protocol error that closes the worker connection, failing every request on it."""
    async with httpx.AsyncClient(base_url=real.url) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, field: value, "stream": stream})
        assert r.status_code == 400, r.text
        assert error_of(r.content)["param"] == field
        ok = {**CHAT, "seed": -(2**63)} if field == "seed" else {**CHAT, "top_k": 2**63 - 1}
        r = await c.post("/v1/chat/completions", json=ok)
        assert r.status_code == 200, r.text
    assert not real.conn.closed
