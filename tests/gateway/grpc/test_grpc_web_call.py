"""gRPC-Web calls end to end without HTTP: body chunks in, the Inference service (over the
echo backend double), response bytes out -- every content type, each compression, a bidi
Chat, malformed bodies, deadlines. The responses are parsed here independently of the
writer: base64 per write, then frames by hand.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import pytest

from gateway.errors import APIError
from gateway.grpc.compression import Codecs
from gateway.grpc.grpc_web_route import serve_web_call
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.grpc.service import InferenceService
from tests.gateway.grpc.backend_double import EchoBackendDouble
from tests.gateway.grpc.web_client import CODECS, Parsed, frame, parse_body

pytestmark = pytest.mark.timeout(30)

GENERATE = "/quicserve.v1.Inference/Generate"
CHAT = "/quicserve.v1.Inference/Chat"


@dataclass
class RecordingSink:
    headers: list[tuple[bytes, bytes]] | None = None
    writes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.changed = asyncio.Event()

    async def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        assert self.headers is None, "headers sent twice"
        self.headers = headers

    async def write(self, data: bytes) -> None:
        assert self.headers is not None, "body before headers"
        self.writes.append(data)
        self.changed.set()


def parse(sink: RecordingSink, text: bool) -> Parsed:
    raw = b"".join(base64.b64decode(w, validate=True) if text else w for w in sink.writes)
    return parse_body(raw, dict(sink.headers or []).get(b"grpc-encoding", b"").decode())


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def run(path: str, body: bytes | AsyncIterator[bytes], backend: EchoBackendDouble | None = None,
              ctype: str = "application/grpc-web+proto", extra: Iterable[tuple[bytes, bytes]] = (),
              max_message: int = 1 << 16) -> tuple[RecordingSink, Parsed]:
    service = InferenceService(backend or EchoBackendDouble())
    text = "text" in ctype
    if isinstance(body, bytes):
        body = chunks(*(base64.b64encode(body[i:i + 7]) if text else body[i:i + 7]
                        for i in range(0, len(body), 7)))
    headers = {b"content-type": ctype.encode(), **dict(extra)}
    sink = RecordingSink()
    await serve_web_call(service.__mapping__(), path, headers, body, sink, Codecs(), max_message)
    return sink, parse(sink, text)


def generate(prompt: str) -> bytes:
    return frame(pb.GenerateRequest(model="tiny", prompt=prompt).SerializeToString())


CONTENT_TYPES = ["application/grpc-web", "application/grpc-web+proto", "application/grpc-web-text",
                 "application/grpc-web-text+proto"]


@pytest.mark.parametrize("ctype", CONTENT_TYPES)
@pytest.mark.parametrize("encoding", ["identity", "gzip", "zstd"])
async def test_generate_every_content_type_and_compression(ctype: str, encoding: str) -> None:
    long_prompt = " ".join(["word"] * 40)
    request = pb.GenerateRequest(model="tiny", prompt=long_prompt).SerializeToString()
    body = frame(CODECS[encoding].compress(request), 1) if encoding != "identity" else frame(request)
    backend = EchoBackendDouble()
    sink, got = await run(GENERATE, body, backend, ctype=ctype,
                          extra=[(b"grpc-encoding", encoding.encode()), (b"grpc-accept-encoding", encoding.encode()),
                                 (b"authorization", b"Bearer k")])
    headers = dict(sink.headers or [])
    assert headers[b"content-type"] == (b"application/grpc-web-text+proto" if "text" in ctype
                                        else b"application/grpc-web+proto")
    assert headers.get(b"grpc-encoding") == (None if encoding == "identity" else encoding.encode())
    replies = [pb.GenerateResponse.FromString(m) for m in got.messages]
    assert "".join(r.text for r in replies) == " ".join(["WORD"] * 40)
    assert replies[-1].finish_reason == pb.FINISH_REASON_STOP
    assert got.trailers == {"grpc-status": "0"}
    assert dict(backend.calls[0].spec.metadata) == {"content-type": ctype, "authorization": "Bearer k"}
    if "text" in ctype:
        assert all(len(w) % 4 == 0 for w in sink.writes)  # one padded base64 segment per write


async def test_bidi_chat_reads_turns_while_it_replies() -> None:
    backend = EchoBackendDouble()
    body: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def client_body() -> AsyncIterator[bytes]:
        while (chunk := await body.get()) is not None:
            yield chunk

    def turn(text: str, model: str = "") -> bytes:
        t = pb.Turn(model=model, messages=[pb.Message(role="user", content=text)])
        return frame(pb.ChatRequest(turn=t).SerializeToString())

    sink = RecordingSink()
    call = asyncio.create_task(serve_web_call(InferenceService(backend).__mapping__(), CHAT,
                                              {b"content-type": b"application/grpc-web"}, client_body(), sink,
                                              Codecs(), 1 << 16))

    async def replies_until_finish(n: int) -> None:
        while not any(pb.ChatResponse.FromString(w[5:]).finish_reason for w in sink.writes[n:]):
            sink.changed.clear()
            await asyncio.wait_for(sink.changed.wait(), 10)

    await body.put(turn("hello there", model="tiny"))
    await replies_until_finish(0)  # the first reply is complete while the request body is still open
    done_first = len(sink.writes)
    await body.put(turn("and again"))
    await replies_until_finish(done_first)
    await body.put(None)
    await asyncio.wait_for(call, 10)
    got = parse(sink, text=False)
    replies = [pb.ChatResponse.FromString(m) for m in got.messages]
    assert "".join(r.text for r in replies if r.turn == 1) == "HELLO THERE"
    assert "".join(r.text for r in replies if r.turn == 2) == "AND AGAIN"
    assert got.trailers == {"grpc-status": "0"}
    assert [m.content for m in backend.calls[1].spec.messages or ()] == ["hello there", "HELLO THERE",
                                                                        "and again"]


@pytest.mark.parametrize(("body", "ctype", "status"), [
    (frame(b"x", 0x80), "application/grpc-web", "13"),  # trailer flag in a request
    (frame(b"\xff\xff\xff"), "application/grpc-web", "13"),  # not a protobuf message
    (generate("hi")[:-2], "application/grpc-web", "13"),  # truncated
    (frame(b"x" * 2000), "application/grpc-web", "8"),  # over max_message
])
async def test_malformed_bodies_get_clean_trailers(body: bytes, ctype: str, status: str) -> None:
    backend = EchoBackendDouble()
    _sink, got = await run(GENERATE, body, backend, ctype=ctype, max_message=1000)
    assert got.trailers["grpc-status"] == status and got.messages == []
    assert backend.calls == []
    _sink, again = await run(GENERATE, generate("still fine"), backend)  # the service is unharmed
    assert again.trailers == {"grpc-status": "0"}


async def test_text_body_that_is_not_base64_is_invalid_argument() -> None:
    sink = RecordingSink()
    await serve_web_call(InferenceService(EchoBackendDouble()).__mapping__(), GENERATE,
                         {b"content-type": b"application/grpc-web-text"}, chunks(b"AAAA!!!!"), sink,
                         Codecs(), 1000)
    assert parse(sink, text=True).trailers["grpc-status"] == "3"


async def test_unknown_method_and_unknown_encoding_are_unimplemented() -> None:
    _s, got = await run("/quicserve.v1.Inference/Nope", generate("x"))
    assert got.trailers["grpc-status"] == "12"
    sink, got = await run(GENERATE, generate("x"), extra=[(b"grpc-encoding", b"br")])
    assert got.trailers["grpc-status"] == "12" and "br" in got.trailers["grpc-message"]
    assert (b"grpc-accept-encoding", b"zstd,gzip,identity") in (sink.headers or [])


async def test_backend_errors_become_trailers() -> None:
    backend = EchoBackendDouble()
    backend.reject = APIError(429, "Too many requests, slow down.", "rate_limit_error", retry_after=3)
    _s, got = await run(GENERATE, generate("x"), backend)
    assert got.trailers == {"grpc-status": "8", "grpc-message": "Too many requests, slow down.",
                            "retry-after": "3"}


async def test_zstd_compresses_a_long_trailer_frame() -> None:
    backend = EchoBackendDouble()
    backend.reject = APIError(503, "Every replica is busy; " * 10, "server_error")
    _s, got = await run(GENERATE, generate("x"), backend, extra=[(b"grpc-accept-encoding", b"zstd")])
    assert got.trailer_flags == 0x81 and got.trailers["grpc-status"] == "14"


async def test_grpc_timeout_expires_and_cancels_the_generation() -> None:
    backend = EchoBackendDouble()
    backend.hang_after = 1
    _s, got = await run(GENERATE, generate("a b c"), backend, extra=[(b"grpc-timeout", b"50m")])
    assert got.trailers["grpc-status"] == "4"
    assert [pb.GenerateResponse.FromString(m).text for m in got.messages] == ["A"]
    assert backend.calls[0].cancelled.is_set()
    _s, got = await run(GENERATE, generate("a"), extra=[(b"grpc-timeout", b"soon")])
    assert got.trailers["grpc-status"] == "13"  # INTERNAL: a protocol error (as grpc-go answers it)


async def test_a_malformed_message_mid_chat_cancels_the_running_turn_and_fails_the_call() -> None:
    backend = EchoBackendDouble()
    backend.hang_after = 1
    body: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def client_body() -> AsyncIterator[bytes]:
        while (chunk := await body.get()) is not None:
            yield chunk

    turn = pb.ChatRequest(turn=pb.Turn(model="tiny", messages=[pb.Message(role="user", content="a b c")]))
    sink = RecordingSink()
    call = asyncio.create_task(serve_web_call(InferenceService(backend).__mapping__(), CHAT,
                                              {b"content-type": b"application/grpc-web"}, client_body(), sink,
                                              Codecs(), 1 << 16))
    await body.put(frame(turn.SerializeToString()) + frame(turn.SerializeToString()))  # turn 2 queued
    await asyncio.wait_for(backend.started.wait(), 10)
    await body.put(frame(b"x", 0x80))  # then garbage, with turn 1 hanging and the body still open
    await asyncio.wait_for(call, 10)
    got = parse(sink, text=False)
    assert got.trailers["grpc-status"] == "13"
    assert backend.calls[0].cancelled.is_set() and len(backend.calls) == 1  # turn 2 never ran


async def test_a_unary_call_without_its_message_is_internal() -> None:
    backend = EchoBackendDouble()
    _s, got = await run(GENERATE, b"", backend)
    assert got.trailers == {"grpc-status": "13", "grpc-message": "no request message"} and backend.calls == []
