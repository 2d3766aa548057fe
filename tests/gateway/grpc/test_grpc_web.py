"""gRPC-Web bodies: request bytes in (binary and base64 text, any split) -> events; responses out."""

from __future__ import annotations

import base64
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.grpc.compression import Codecs, GzipCodec, ZstdCodec
from gateway.grpc.grpc_web import (
    CallFailed,
    MessageReceived,
    Rejection,
    RequestEnded,
    WebCall,
    WebEvent,
    WebRequestReader,
    WebResponseWriter,
    is_grpc_web,
    open_call,
)
from gateway.grpc.status import Status

ACCEPT = "zstd,gzip,identity"
MESSAGES = [b"\x0a\x02hi", b"", b"x" * 300]


def frame(payload: bytes, flags: int = 0) -> bytes:
    return bytes([flags]) + struct.pack(">I", len(payload)) + payload


BODY = b"".join(frame(m) for m in MESSAGES)
EXPECTED: list[WebEvent] = [*(MessageReceived(m) for m in MESSAGES), RequestEnded()]


def feed(reader: WebRequestReader, pieces: list[bytes]) -> list[WebEvent]:
    events = [e for p in pieces for e in reader.receive_data(p)]
    return events + reader.end_of_stream()


def split(body: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted(cuts)
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


def reader(text: bool = False, codec: GzipCodec | ZstdCodec | None = None, limit: int = 1000) -> WebRequestReader:
    return WebRequestReader(text=text, codec=codec, max_message=limit)


# -- requests: binary ---------------------------------------------------------------------------

def test_binary_body_in_one_piece_and_byte_at_a_time() -> None:
    assert feed(reader(), [BODY]) == EXPECTED
    assert feed(reader(), [BODY[i:i + 1] for i in range(len(BODY))]) == EXPECTED


@given(st.lists(st.integers(0, len(BODY)), max_size=12))
def test_binary_body_any_split(cuts: list[int]) -> None:
    assert feed(reader(), split(BODY, cuts)) == EXPECTED


def test_empty_body_is_a_clean_end() -> None:
    assert feed(reader(), []) == [RequestEnded()]


# -- requests: grpc-web-text --------------------------------------------------------------------

TEXT_BODY = base64.b64encode(BODY)
# Clients may base64 each message on its own: padded segments back to back.
SEGMENTED = b"".join(base64.b64encode(frame(m)) for m in MESSAGES)


def test_segmented_text_really_has_padding_inside() -> None:
    assert b"=" in SEGMENTED.rstrip(b"=")


@pytest.mark.parametrize("body", [TEXT_BODY, SEGMENTED], ids=["one-segment", "padded-segments"])
def test_text_body_in_one_piece_and_byte_at_a_time(body: bytes) -> None:
    assert feed(reader(text=True), [body]) == EXPECTED
    assert feed(reader(text=True), [body[i:i + 1] for i in range(len(body))]) == EXPECTED


@given(st.sampled_from([TEXT_BODY, SEGMENTED]), st.lists(st.integers(0, len(SEGMENTED)), max_size=12))
def test_text_body_any_split(body: bytes, cuts: list[int]) -> None:
    assert feed(reader(text=True), split(body, [min(c, len(body)) for c in cuts])) == EXPECTED


@given(st.lists(st.binary(max_size=50), max_size=5), st.data())
def test_any_messages_any_segmentation_any_split(msgs: list[bytes], data: st.DataObject) -> None:
    frames = [frame(m) for m in msgs]
    # Group consecutive frames into segments, base64 each, then split the text anywhere.
    bounds = sorted(data.draw(st.lists(st.integers(0, len(frames)), max_size=4)))
    groups = split(b"".join(frames), [sum(map(len, frames[:b])) for b in bounds])
    body = b"".join(base64.b64encode(g) for g in groups)
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=8))
    assert feed(reader(text=True), split(body, cuts)) == [*map(MessageReceived, msgs), RequestEnded()]


def test_unpadded_final_segment_is_accepted() -> None:
    body = base64.b64encode(frame(b"ab")).rstrip(b"=")
    assert len(body) % 4 != 0
    assert feed(reader(text=True), [body]) == [MessageReceived(b"ab"), RequestEnded()]


@pytest.mark.parametrize("body", [b"AAAA*AAA", b"AA=A", b"A===", b"AAAAA"])
def test_bad_base64_is_invalid_argument(body: bytes) -> None:
    events = feed(reader(text=True), [body])
    assert len(events) == 1 and isinstance(events[0], CallFailed)
    assert events[0].status is Status.INVALID_ARGUMENT


# -- requests: malformed and oversized -----------------------------------------------------------

@pytest.mark.parametrize(("body", "status"), [
    (frame(b"a", 0x80), Status.INTERNAL),  # a trailer frame in a request
    (frame(b"a", 0x02), Status.INTERNAL),  # reserved flag bits
    (frame(b"a", 0x01), Status.INTERNAL),  # compressed, but grpc-encoding is identity
    (frame(b"a")[:4], Status.INTERNAL),  # body ends inside a header
    (frame(b"abc")[:-1], Status.INTERNAL),  # body ends inside a message
    (b"\x00" + struct.pack(">I", 1001), Status.RESOURCE_EXHAUSTED),  # over max_message
])
def test_malformed_binary_body(body: bytes, status: Status) -> None:
    events = feed(reader(), [frame(b"ok"), body])
    assert events[0] == MessageReceived(b"ok")
    assert len(events) == 2 and isinstance(events[1], CallFailed) and events[1].status is status


def test_after_a_failure_the_reader_ignores_further_bytes() -> None:
    r = reader()
    assert [type(e) for e in r.receive_data(frame(b"a", 0x80))] == [CallFailed]
    assert r.receive_data(frame(b"b")) == [] and r.end_of_stream() == []


@pytest.mark.parametrize("codec", [GzipCodec(), ZstdCodec()], ids=lambda c: c.name)
def test_compressed_request_messages(codec: GzipCodec | ZstdCodec) -> None:
    text = b"tell me a story " * 30
    body = frame(codec.compress(text), 0x01) + frame(b"plain")
    assert feed(reader(codec=codec), [body]) == [MessageReceived(text), MessageReceived(b"plain"), RequestEnded()]
    corrupt = feed(reader(codec=codec), [frame(b"garbage!", 0x01)])
    assert isinstance(corrupt[0], CallFailed) and corrupt[0].status is Status.INTERNAL
    bomb = feed(reader(codec=codec, limit=1000), [frame(codec.compress(b"\0" * 100_000), 0x01)])
    assert isinstance(bomb[0], CallFailed) and bomb[0].status is Status.RESOURCE_EXHAUSTED


# -- responses ---------------------------------------------------------------------------------

def test_binary_response_frames_and_trailers() -> None:
    w = WebResponseWriter(text=False, codec=None, accept_encoding=ACCEPT)
    assert w.message(b"\x0a\x02hi") == b"\x00\x00\x00\x00\x04\x0a\x02hi"
    assert w.trailers(Status.OK) == b"\x80\x00\x00\x00\x0fgrpc-status:0\r\n"
    body = w.trailers(Status.INVALID_ARGUMENT, "bad température 100%", [("retry-after", "10")])
    assert body[0] == 0x80 and struct.unpack(">I", body[1:5])[0] == len(body) - 5
    assert body[5:] == (b"grpc-status:3\r\ngrpc-message:bad temp%C3%A9rature 100%25\r\n"
                        b"retry-after:10\r\n")


def test_text_response_is_one_padded_segment_per_write() -> None:
    w = WebResponseWriter(text=True, codec=None, accept_encoding=ACCEPT)
    b = WebResponseWriter(text=False, codec=None, accept_encoding=ACCEPT)
    for out, raw in [(w.message(b"hey"), b.message(b"hey")), (w.trailers(Status.OK), b.trailers(Status.OK))]:
        assert len(out) % 4 == 0 and base64.b64decode(out, validate=True) == raw


def test_response_headers() -> None:
    assert WebResponseWriter(text=False, codec=None, accept_encoding=ACCEPT).headers() == [
        (b"content-type", b"application/grpc-web+proto"), (b"grpc-accept-encoding", b"zstd,gzip,identity")]
    assert dict(WebResponseWriter(text=True, codec=ZstdCodec(), accept_encoding=ACCEPT).headers()) == {
        b"content-type": b"application/grpc-web-text+proto", b"grpc-accept-encoding": ACCEPT.encode(),
        b"grpc-encoding": b"zstd"}


def test_zstd_compresses_the_trailer_frame_when_it_shrinks() -> None:
    codec = ZstdCodec()
    w = WebResponseWriter(text=False, codec=codec, accept_encoding=ACCEPT)
    long = w.trailers(Status.INTERNAL, "worker failed: " + "out of memory; " * 20)
    assert long[0] == 0x81
    block = codec.decompress(long[5:], 10_000)
    assert block.startswith(b"grpc-status:13\r\ngrpc-message:worker failed")
    assert w.trailers(Status.OK) == b"\x80\x00\x00\x00\x0fgrpc-status:0\r\n"  # would not shrink


def test_gzip_leaves_the_trailer_frame_plain_and_compresses_messages() -> None:
    w = WebResponseWriter(text=False, codec=GzipCodec(), accept_encoding=ACCEPT)
    assert w.trailers(Status.INTERNAL, "x" * 500)[0] == 0x80
    assert w.message(b"y" * 500)[0] == 0x01


# -- opening a call ------------------------------------------------------------------------------

@pytest.mark.parametrize(("ctype", "web"), [
    (b"application/grpc-web", True), (b"application/grpc-web+proto", True),
    (b"application/grpc-web-text", True), (b"Application/GRPC-Web-Text+proto; charset=utf-8", True),
    (b"application/grpc-web+json", False), (b"application/grpc", False), (b"application/json", False),
])
def test_content_types(ctype: bytes, web: bool) -> None:
    assert is_grpc_web(ctype) is web


def test_open_call_negotiates_codecs_and_text() -> None:
    call = open_call({b"content-type": b"application/grpc-web-text", b"grpc-encoding": b"gzip",
                      b"grpc-accept-encoding": b"zstd"}, Codecs(), 1000)
    assert isinstance(call, WebCall) and call.writer.text
    assert call.writer.codec is not None and call.writer.codec.name == "zstd"
    body = base64.b64encode(frame(GzipCodec().compress(b"q" * 100), 0x01))
    assert feed(call.reader, [body]) == [MessageReceived(b"q" * 100), RequestEnded()]


def test_unknown_encoding_is_rejected_unimplemented_with_the_accepted_list() -> None:
    got = open_call({b"content-type": b"application/grpc-web", b"grpc-encoding": b"br"}, Codecs(), 1000)
    assert isinstance(got, Rejection) and got.status is Status.UNIMPLEMENTED
    assert (b"grpc-accept-encoding", b"zstd,gzip,identity") in got.writer.headers()
    assert got.writer.trailers(got.status, got.message).startswith(b"\x80")
