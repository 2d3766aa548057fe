"""GrpcFrameWriter at the byte level: what native Generate puts on the wire, message by message."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.grpc.compression import Codecs, GzipCodec
from gateway.grpc.framing import FrameDecoder
from gateway.grpc.native import NativeResponseWriter
from gateway.grpc.native_frame_writer import GrpcFrameWriter, text_message
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from transport.messages import Finish, FinishReason

ACCEPT = Codecs().accept_encoding


def _writer(codec: GzipCodec | None = None) -> GrpcFrameWriter:
    return GrpcFrameWriter(NativeResponseWriter(codec, ACCEPT))


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    return [(f.flags, f.payload) for f in FrameDecoder(1 << 30).feed(data)]


@pytest.mark.parametrize("text", [b"", b"a", b"x" * 127, b"x" * 128, b"y" * 300, b"z" * 20000,
                                  "h\u00e9llo \u4e16\u754c".encode(), b"\xe4\xb8"])
def test_text_message_is_what_protobuf_serializes(text: bytes) -> None:
    expected = pb.GenerateResponse(text=text.decode("utf-8", "replace")).SerializeToString()
    assert text_message(text) == (expected if text else b"\x0a\x00")
    assert pb.GenerateResponse.FromString(text_message(text)).text == text.decode("utf-8", "replace")


def test_headers_and_one_frame_per_delta() -> None:
    w = _writer()
    assert w.streaming and w.trailers is None and w.opening() == b""
    assert dict(w.headers)[b"content-type"] == b"application/grpc"
    assert b"grpc-encoding" not in dict(w.headers)
    assert w.text(b"ab") == b"\x00\x00\x00\x00\x04\x0a\x02ab"
    assert w.text(b"") == b""  # an engine step with no text: no empty message


def test_finish_is_the_last_message_then_status_ok() -> None:
    w = _writer()
    out = w.finish(Finish(1, FinishReason.LENGTH, 7, 5, 2))
    [(flags, payload)] = _frames(out)
    last = pb.GenerateResponse.FromString(payload)
    assert flags == 0 and last.text == "" and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (7, 5, 2)
    assert w.trailers == [(b"grpc-status", b"0")]


def test_a_cancelled_finish_ends_cancelled() -> None:
    w = _writer()
    assert w.finish(Finish(1, FinishReason.CANCELLED, 7, 1)) == b""
    assert w.trailers is not None and dict(w.trailers)[b"grpc-status"] == b"1"


def test_errors_map_to_status_in_trailers_or_trailers_only() -> None:
    w = _writer()
    err = APIError(429, "slow down", "rate_limit_error", None, "rate_limited", retry_after=2.2)
    status, headers, body = w.error(err)
    h = dict(headers)
    assert (status, body) == (200, b"")
    assert h[b"content-type"] == b"application/grpc" and h[b"grpc-status"] == b"8"
    assert h[b"grpc-message"] == b"slow down" and h[b"retry-after"] == b"3"  # 2.2 s rounded up
    assert w.trailers is None  # a trailers-only response carries its status itself
    assert w.stream_error(APIError(504, "too late")) == b""
    assert w.trailers is not None and dict(w.trailers)[b"grpc-status"] == b"4"


def test_compression_with_the_negotiated_codec() -> None:
    w = _writer(GzipCodec(min_size=64))
    assert dict(w.headers)[b"grpc-encoding"] == b"gzip"
    [(flags, payload)] = _frames(w.text(b"tok"))
    assert flags == 0 and pb.GenerateResponse.FromString(payload).text == "tok"  # too short to try
    [(flags, payload)] = _frames(w.text(b"abc " * 100))
    assert flags == 1
    assert pb.GenerateResponse.FromString(GzipCodec().decompress(payload, 1 << 20)).text == "abc " * 100
