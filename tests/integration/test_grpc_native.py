"""Native gRPC: our HTTP/2 listener running the grpclib service handlers on 127.0.0.1 port 0,
driven by the official grpcio client (C core), by grpcurl through server reflection, and by a raw
h2 client where the bytes on the wire are the point (compression flags, trailers). The backend is a double that echoes the
last message upper-cased, one word per message (see tests/gateway/grpc/backend_double.py).
"""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from gateway import clock
from gateway.errors import APIError
from gateway.grpc.compression import GzipCodec
from gateway.grpc.native_server import start_native
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from tests.gateway.grpc.backend_double import EchoBackendDouble
from tests.gateway.grpc.h2_client import RawH2
from tests.gateway.grpc.web_client import CODECS, frame

pytestmark = pytest.mark.timeout(60)

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
METHOD = "/quicserve.v1.Inference/"


@pytest.fixture
def backend() -> EchoBackendDouble:
    return EchoBackendDouble(("tiny", "tiny-chat"))


@pytest.fixture
async def target(backend: EchoBackendDouble) -> AsyncIterator[str]:
    native = await start_native(backend, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{native.port}"
    finally:
        await native.close()


def _channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target)


def _unary(ch: grpc.Channel, name: str, resp: type) -> grpc.UnaryUnaryMultiCallable:
    return ch.unary_unary(METHOD + name, request_serializer=lambda m: m.SerializeToString(),
                          response_deserializer=resp.FromString)


def _server_stream(ch: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    return ch.unary_stream(METHOD + "Generate", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=pb.GenerateResponse.FromString)


def _bidi(ch: grpc.Channel) -> grpc.StreamStreamMultiCallable:
    return ch.stream_stream(METHOD + "Chat", request_serializer=lambda m: m.SerializeToString(),
                            response_deserializer=pb.ChatResponse.FromString)


async def _wait(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), 10)


# -- unary and server streaming ------------------------------------------------------------------

async def test_complete_unary(target: str, backend: EchoBackendDouble) -> None:
    def call() -> pb.GenerateResponse:
        with _channel(target) as ch:
            req = pb.GenerateRequest(model="tiny", prompt="hello big world")
            return _unary(ch, "Complete", pb.GenerateResponse)(
                req, timeout=10, metadata=(("authorization", "Bearer sk-test"), ("trace-bin", b"\x00")))

    reply = await asyncio.to_thread(call)
    assert reply.text == "HELLO BIG WORLD"
    assert reply.finish_reason == pb.FINISH_REASON_STOP
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3, 3)
    # The caller's credentials reach the backend for admission; binary metadata does not.
    metadata = dict(backend.calls[0].spec.metadata)
    assert metadata["authorization"] == "Bearer sk-test" and "trace-bin" not in metadata


async def test_generate_streams_deltas_then_finish(target: str, backend: EchoBackendDouble) -> None:
    def call() -> list[pb.GenerateResponse]:
        with _channel(target) as ch:
            req = pb.GenerateRequest(model="tiny", prompt="one two three four",
                                     sampling=pb.Sampling(max_tokens=3, temperature=0.5, stop=["x"]))
            return list(_server_stream(ch)(req))

    replies = await asyncio.to_thread(call)
    assert "".join(r.text for r in replies) == "ONE TWO THREE"
    assert len(replies) >= 2  # streamed, not buffered into one message
    *deltas, last = replies
    # Deltas carry only text: finish_reason and usage are left at their defaults (not sent).
    assert all(d.finish_reason == 0 and not d.HasField("usage") for d in deltas)
    assert all(len(d.SerializeToString()) == 2 + len(d.text.encode()) for d in deltas)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 3)
    spec = backend.calls[0].spec
    assert (spec.model, spec.prompt, spec.messages) == ("tiny", "one two three four", None)
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.stop, spec.seed, spec.deadline) == (
        3, 0.5, None, ("x",), None, None)


async def test_generate_from_a_conversation(target: str, backend: EchoBackendDouble) -> None:
    def call() -> list[pb.GenerateResponse]:
        conv = pb.Conversation(messages=[pb.Message(role="system", content="be loud"),
                                         pb.Message(role="user", content="hi there")])
        with _channel(target) as ch:
            return list(_server_stream(ch)(pb.GenerateRequest(model="tiny-chat", conversation=conv)))

    replies = await asyncio.to_thread(call)
    assert "".join(r.text for r in replies) == "HI THERE"
    assert [(m.role, m.content) for m in backend.calls[0].spec.messages or ()] == [
        ("system", "be loud"), ("user", "hi there")]


async def test_list_models(target: str) -> None:
    def call() -> pb.ListModelsResponse:
        with _channel(target) as ch:
            return _unary(ch, "ListModels", pb.ListModelsResponse)(pb.ListModelsRequest(), timeout=10)

    assert [m.id for m in (await asyncio.to_thread(call)).models] == ["tiny", "tiny-chat"]


# -- errors ------------------------------------------------------------------------------------

def _complete_error(target: str, req: pb.GenerateRequest) -> grpc.RpcError:
    with _channel(target) as ch:
        try:
            _unary(ch, "Complete", pb.GenerateResponse)(req, timeout=10)
        except grpc.RpcError as e:
            return e
    raise AssertionError("the call succeeded")


async def test_errors_map_to_status_codes(target: str, backend: EchoBackendDouble) -> None:
    err = await asyncio.to_thread(_complete_error, target, pb.GenerateRequest(model="tiny"))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert backend.calls == []  # rejected before any generation

    backend.reject = APIError(404, "The model 'nope' does not exist.", code="model_not_found")
    err = await asyncio.to_thread(_complete_error, target, pb.GenerateRequest(model="nope", prompt="x"))
    assert err.code() is grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert err.details() == "The model 'nope' does not exist."  # type: ignore[attr-defined]

    backend.reject = APIError(429, "Rate limit reached.", "rate_limit_error", retry_after=2.0)
    err = await asyncio.to_thread(_complete_error, target, pb.GenerateRequest(model="tiny", prompt="x"))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert ("retry-after", "2") in err.trailing_metadata()  # type: ignore[attr-defined]


async def test_error_after_some_tokens_ends_the_stream_with_its_status(
        target: str, backend: EchoBackendDouble) -> None:
    backend.hang_after = 2
    backend.fail = APIError(502, "Lost the worker.", "server_error", code="worker_connection_lost")

    def call() -> tuple[list[str], grpc.RpcError]:
        got: list[str] = []
        with _channel(target) as ch:
            try:
                for r in _server_stream(ch)(pb.GenerateRequest(model="tiny", prompt="a b c d")):
                    got.append(r.text)
            except grpc.RpcError as e:
                return got, e
        raise AssertionError("the stream ended OK")

    texts, err = await asyncio.to_thread(call)
    assert "".join(texts) == "A B"
    assert err.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


# -- cancellation and deadlines --------------------------------------------------------------------

async def test_client_cancel_reaches_the_backend(target: str, backend: EchoBackendDouble) -> None:
    backend.hang_after = 1
    first = asyncio.Event()
    loop = asyncio.get_running_loop()

    def call() -> grpc.StatusCode:
        with _channel(target) as ch:
            stream = _server_stream(ch)(pb.GenerateRequest(model="tiny", prompt="a b c"))
            assert next(stream).text == "A"
            loop.call_soon_threadsafe(first.set)
            stream.cancel()
            try:
                next(stream)
            except grpc.RpcError as e:
                return e.code()  # type: ignore[attr-defined, no-any-return]
        raise AssertionError("the stream went on after cancel")

    code = await asyncio.to_thread(call)
    assert code is grpc.StatusCode.CANCELLED
    await _wait(backend.calls[0].cancelled)
    assert first.is_set() and not backend.calls[0].ended


async def test_deadline_expiry_cancels_the_generation(target: str, backend: EchoBackendDouble) -> None:
    backend.hang_after = 1

    def call() -> tuple[grpc.StatusCode, float, float]:
        started = clock.now()
        with _channel(target) as ch:
            try:
                list(_server_stream(ch)(pb.GenerateRequest(model="tiny", prompt="a b c"), timeout=0.5))
            except grpc.RpcError as e:
                return e.code(), started, clock.now()  # type: ignore[attr-defined]
        raise AssertionError("the stream ended OK")

    code, started, ended = await asyncio.to_thread(call)
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    await _wait(backend.calls[0].cancelled)
    # grpc-timeout reached the spec: 0.5 s from when the server read the headers, which is
    # after the call started and before it ended (the C core rounds the timeout up, not down).
    deadline = backend.calls[0].spec.deadline
    assert deadline is not None and started < deadline <= ended + 0.5


# -- bidi chat ---------------------------------------------------------------------------------

class _Turns:
    """The client side of a Chat call: send requests, read replies one at a time."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._requests: queue.Queue[pb.ChatRequest | None] = queue.Queue()
        self._channel = _channel(target)
        self._replies = _bidi(self._channel)(self._iter(), timeout=20, metadata=metadata)

    def _iter(self) -> Iterator[pb.ChatRequest]:
        while (r := self._requests.get()) is not None:
            yield r

    def send(self, request: pb.ChatRequest) -> None:
        self._requests.put(request)

    def turn(self, text: str, model: str = "") -> None:
        self.send(pb.ChatRequest(turn=pb.Turn(model=model, messages=[pb.Message(role="user", content=text)])))

    def until_end_of_turn(self) -> list[pb.ChatResponse]:
        got = []
        while True:
            got.append(next(self._replies))
            if got[-1].finish_reason or got[-1].HasField("error"):
                return got

    def close(self) -> list[pb.ChatResponse]:
        self._requests.put(None)
        rest = list(self._replies)
        self._channel.close()
        return rest


async def test_chat_turns_keep_the_conversation(target: str, backend: EchoBackendDouble) -> None:
    def call() -> tuple[list[pb.ChatResponse], list[pb.ChatResponse], list[pb.ChatResponse]]:
        chat = _Turns(target, metadata=(("x-api-key", "k1"),))
        chat.turn("hi there", model="tiny-chat")
        one = chat.until_end_of_turn()
        chat.turn("how are you")
        two = chat.until_end_of_turn()
        return one, two, chat.close()

    one, two, rest = await asyncio.to_thread(call)
    assert {r.turn for r in one} == {1} and {r.turn for r in two} == {2}
    assert "".join(r.text for r in one) == "HI THERE" and "".join(r.text for r in two) == "HOW ARE YOU"
    assert two[-1].finish_reason == pb.FINISH_REASON_STOP
    assert two[-1].usage.prompt_tokens == 7  # "hi there" + "HI THERE" + "how are you"
    assert rest == []
    assert backend.calls[1].spec.model == "tiny-chat"  # inherited from the first turn
    assert ("x-api-key", "k1") in backend.calls[1].spec.metadata
    assert [(m.role, m.content) for m in backend.calls[1].spec.messages or ()] == [
        ("user", "hi there"), ("assistant", "HI THERE"), ("user", "how are you")]


async def test_chat_cancel_one_turn_and_go_on(target: str, backend: EchoBackendDouble) -> None:
    backend.hang_after = 1
    loop = asyncio.get_running_loop()

    def call() -> tuple[list[pb.ChatResponse], list[pb.ChatResponse]]:
        chat = _Turns(target)
        chat.turn("never ending story", model="tiny")
        first = [next(chat._replies)]
        chat.send(pb.ChatRequest(cancel=pb.CancelTurn(turn=1)))
        first += chat.until_end_of_turn()
        fut = asyncio.run_coroutine_threadsafe(_wait(backend.calls[0].cancelled), loop)
        fut.result(10)
        backend.hang_after = None
        chat.turn("short one")
        second = chat.until_end_of_turn()
        chat.close()
        return first, second

    first, second = await asyncio.to_thread(call)
    assert first[0].text == "NEVER"
    assert first[-1].error.code == grpc.StatusCode.CANCELLED.value[0]
    assert second[-1].turn == 2 and "".join(r.text for r in second) == "SHORT ONE"
    # The cancelled turn did not join the conversation.
    assert [m.content for m in backend.calls[1].spec.messages or ()] == ["short one"]


async def test_chat_turn_errors_do_not_end_the_call(target: str, backend: EchoBackendDouble) -> None:
    def call() -> tuple[list[pb.ChatResponse], list[pb.ChatResponse]]:
        chat = _Turns(target)
        chat.turn("no model yet")
        bad = chat.until_end_of_turn()
        chat.turn("now with one", model="tiny")
        good = chat.until_end_of_turn()
        chat.close()
        return bad, good

    bad, good = await asyncio.to_thread(call)
    assert bad[-1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "model" in bad[-1].error.message
    assert good[-1].turn == 2 and good[-1].finish_reason == pb.FINISH_REASON_STOP


# -- grpcurl through reflection, and health ------------------------------------------------------

def _grpcurl(*args: str) -> str:
    done = subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_grpcurl_lists_describes_and_calls_generate(target: str) -> None:
    listed = (await asyncio.to_thread(_grpcurl, target, "list")).split()
    assert {"quicserve.v1.Inference", "grpc.health.v1.Health"} <= set(listed)
    described = await asyncio.to_thread(_grpcurl, target, "describe", "quicserve.v1.Inference")
    assert "rpc Generate ( .quicserve.v1.GenerateRequest ) returns ( stream .quicserve.v1.GenerateResponse )" \
        in described
    out = await asyncio.to_thread(_grpcurl, "-d", '{"model": "tiny", "prompt": "stream me please"}',
                                  target, "quicserve.v1.Inference/Generate")
    replies = [json.loads(chunk) for chunk in out.replace("}\n{", "}\x00{").split("\x00")]
    assert "".join(r.get("text", "") for r in replies) == "STREAM ME PLEASE"
    assert replies[-1]["finish_reason"] == "FINISH_REASON_STOP"
    assert replies[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3}


async def test_health_serving_until_close(backend: EchoBackendDouble) -> None:
    native = await start_native(backend, "127.0.0.1", 0)
    target = f"127.0.0.1:{native.port}"
    try:
        out = await asyncio.to_thread(_grpcurl, target, "grpc.health.v1.Health/Check")
        assert json.loads(out) == {"status": "SERVING"}
        out = await asyncio.to_thread(_grpcurl, "-d", '{"service": "quicserve.v1.Inference"}', target,
                                      "grpc.health.v1.Health/Check")
        assert json.loads(out) == {"status": "SERVING"}
        native.health.set(False)  # what close() does first, while draining
        out = await asyncio.to_thread(_grpcurl, target, "grpc.health.v1.Health/Check")
        assert json.loads(out) == {"status": "NOT_SERVING"}
    finally:
        await native.close()


# -- compression: grpc-encoding / grpc-accept-encoding -------------------------------------------

LONG = " ".join(["compressible"] * 60)


async def test_grpcio_with_gzip_compression(target: str, backend: EchoBackendDouble,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The C core compresses its requests with gzip and accepts gzip replies (it lists
    identity, deflate, gzip; the server answers with the best of those it offers: gzip)."""
    used: list[str] = []
    inflate, deflate = GzipCodec.decompress, GzipCodec.compress
    monkeypatch.setattr(GzipCodec, "decompress", lambda self, d, n: used.append("in") or inflate(self, d, n))
    monkeypatch.setattr(GzipCodec, "compress", lambda self, d: used.append("out") or deflate(self, d))
    def call() -> tuple[pb.GenerateResponse, list[pb.GenerateResponse]]:
        with grpc.insecure_channel(target, compression=grpc.Compression.Gzip) as ch:
            unary = _unary(ch, "Complete", pb.GenerateResponse)(pb.GenerateRequest(model="tiny", prompt=LONG),
                                                               timeout=10)
            streamed = list(_server_stream(ch)(pb.GenerateRequest(model="tiny", prompt="a b c"), timeout=10,
                                               compression=grpc.Compression.Gzip))
            return unary, streamed

    unary, streamed = await asyncio.to_thread(call)
    assert unary.text == LONG.upper() and backend.calls[0].spec.prompt == LONG
    assert "".join(r.text for r in streamed) == "A B C"
    assert "in" in used  # requests came gzipped (flag 1, grpc-encoding: gzip)
    assert "out" in used  # and replies went gzipped where that shrank them


def _frames(body: bytes) -> list[tuple[int, bytes]]:
    out, pos = [], 0
    while pos < len(body):
        n = int.from_bytes(body[pos + 1:pos + 5], "big")
        out.append((body[pos], body[pos + 5:pos + 5 + n]))
        pos += 5 + n
    assert pos == len(body)
    return out


def _grpc_headers(*extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/grpc"), (b"te", b"trailers"), *extra]


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
async def test_compressed_calls_on_the_wire(target: str, backend: EchoBackendDouble, encoding: str) -> None:
    """A raw h2 client: the request compressed (flag 1), the reply compressed when that shrinks
    it and sent as is (flag 0) when not, the status in HTTP/2 trailers."""
    codec = CODECS[encoding]
    port = int(target.rsplit(":", 1)[1])
    enc = (b"grpc-encoding", encoding.encode())
    accept = (b"grpc-accept-encoding", encoding.encode())
    async with RawH2(port) as c:
        sid = c.request(METHOD + "Complete", _grpc_headers(enc, accept))
        c.data(sid, frame(codec.compress(pb.GenerateRequest(model="tiny", prompt=LONG).SerializeToString()), 1),
               end=True)
        sid2 = c.request(METHOD + "Generate", _grpc_headers(accept))  # identity request, compressed replies
        c.data(sid2, frame(pb.GenerateRequest(model="tiny", prompt="a b").SerializeToString()), end=True)
        await c.until(lambda: c.ended(sid) and c.ended(sid2))
    head, trailers = c.headers(sid)
    assert head[b":status"] == b"200" and head[b"content-type"] == b"application/grpc"
    assert head[b"grpc-encoding"] == encoding.encode() and head[b"grpc-accept-encoding"] == b"zstd,gzip,identity"
    assert trailers == {b"grpc-status": b"0"}
    [(flags, payload)] = _frames(c.body(sid))
    assert flags == 1 and len(payload) < len(LONG)  # it shrank, so it went compressed
    assert pb.GenerateResponse.FromString(codec.decompress(payload, 1 << 20)).text == LONG.upper()
    assert backend.calls[0].spec.prompt == LONG
    deltas = _frames(c.body(sid2))
    assert [f for f, _ in deltas[:-1]] == [0] * (len(deltas) - 1)  # a word per message: never smaller compressed
    assert "".join(pb.GenerateResponse.FromString(p).text for _, p in deltas) == "A B"
    assert c.headers(sid2)[1] == {b"grpc-status": b"0"}


async def test_an_unknown_encoding_is_unimplemented_with_what_we_accept(target: str,
                                                                        backend: EchoBackendDouble) -> None:
    async with RawH2(int(target.rsplit(":", 1)[1])) as c:
        sid = c.request(METHOD + "Complete", _grpc_headers((b"grpc-encoding", b"br")))
        c.data(sid, frame(b"\x00" * 8, 1), end=True)
        await c.until(lambda: c.ended(sid))
    head, trailers = c.headers(sid)
    assert head[b":status"] == b"200" and head[b"grpc-accept-encoding"] == b"zstd,gzip,identity"
    assert trailers[b"grpc-status"] == b"12"
    assert b"br" in trailers[b"grpc-message"] and b"zstd,gzip,identity" in trailers[b"grpc-message"]
    assert c.body(sid) == b"" and backend.calls == []


async def test_what_is_not_a_grpc_call(target: str) -> None:
    async with httpx.AsyncClient(timeout=10) as client:  # HTTP/1.1
        r = await client.post(f"http://{target}{METHOD}Complete", content=b"",
                              headers={"content-type": "application/grpc"})
    assert r.status_code == 505
    async with RawH2(int(target.rsplit(":", 1)[1])) as c:
        sid = c.request(METHOD + "Complete", [(b"content-type", b"application/json")], end=True)
        await c.until(lambda: c.ended(sid))
    assert c.headers(sid)[0][b":status"] == b"415"


async def test_a_reset_stream_cancels_the_generation(target: str, backend: EchoBackendDouble) -> None:
    backend.hang_after = 1
    async with RawH2(int(target.rsplit(":", 1)[1])) as c:
        sid = c.request(METHOD + "Generate", _grpc_headers())
        c.data(sid, frame(pb.GenerateRequest(model="tiny", prompt="a b c").SerializeToString()), end=True)
        await c.until(lambda: len(c.body(sid)) > 5)
        c.reset(sid)
        await _wait(backend.calls[0].cancelled)
    assert not backend.calls[0].ended


async def test_close_reports_not_serving_then_drains(backend: EchoBackendDouble) -> None:
    native = await start_native(backend, "127.0.0.1", 0)
    backend.hang_after = 1
    try:
        async with RawH2(native.port) as c:
            sid = c.request(METHOD + "Generate", _grpc_headers())
            c.data(sid, frame(pb.GenerateRequest(model="tiny", prompt="a b c").SerializeToString()), end=True)
            await c.until(lambda: len(c.body(sid)) > 5)
            native.stop_accepting()  # what close() does first
            assert native.health.__status__() is False  # NOT_SERVING
            await asyncio.sleep(0.1)
            assert not c.ended(sid) and native.in_flight == 1  # the call in flight goes on
            with pytest.raises(OSError):  # no new connections
                await asyncio.wait_for(asyncio.open_connection("127.0.0.1", native.port), 5)
            await native.close(timeout=0.2)  # it does not end by itself: cut after the timeout
            await _wait(backend.calls[0].cancelled)
    finally:
        await native.close()
