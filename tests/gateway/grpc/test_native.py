"""Native gRPC's sans-I/O core (gateway/grpc/native.py): opening a call from its headers, the
request body split anywhere (Hypothesis), the response headers, frames and trailers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.grpc.compression import Codecs
from gateway.grpc.grpc_web import CallFailed, MessageReceived, RequestEnded, WebEvent
from gateway.grpc.native import NativeCall, NativeRejection, is_grpc, open_call
from gateway.grpc.status import Status
from tests.gateway.grpc.web_client import CODECS, frame

MESSAGES = [b"", b"hello", b"x" * 300, bytes(range(256)) * 3]


def _open(**headers: bytes) -> NativeCall:
    opened = open_call({k.replace("_", "-").encode(): v for k, v in headers.items()}, Codecs(), 1 << 16)
    assert isinstance(opened, NativeCall)
    return opened


def _feed(call: NativeCall, body: bytes, cuts: list[int]) -> list[WebEvent]:
    events: list[WebEvent] = []
    pos = 0
    for cut in sorted(c % (len(body) + 1) for c in cuts):
        events += call.reader.receive_data(body[pos:cut])
        pos = cut
    events += call.reader.receive_data(body[pos:])
    return events + call.reader.end_of_stream()


@pytest.mark.parametrize("encoding", ["identity", "gzip", "zstd"])
@given(cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=12))
def test_request_messages_split_anywhere(encoding: str, cuts: list[int]) -> None:
    codec = CODECS.get(encoding)
    body = b"".join(frame(codec.compress(m), 1) if codec and i % 2 else frame(m) for i, m in enumerate(MESSAGES))
    events = _feed(_open(grpc_encoding=encoding.encode()), body, cuts)
    assert events == [*(MessageReceived(m) for m in MESSAGES), RequestEnded()]


@given(cut=st.integers(min_value=1, max_value=9))
def test_a_body_that_ends_inside_a_frame_is_internal(cut: int) -> None:
    events = _feed(_open(), frame(b"truncated")[:-cut], [cut])
    assert len(events) == 1 and isinstance(events[0], CallFailed) and events[0].status is Status.INTERNAL


def test_request_flags_and_limits() -> None:
    [failed] = _open().reader.receive_data(frame(b"x", 0x80))  # gRPC-Web's trailer flag: not in native
    assert isinstance(failed, CallFailed) and failed.status is Status.INTERNAL
    [failed] = _open().reader.receive_data(frame(b"x", 1))  # compressed without a grpc-encoding
    assert isinstance(failed, CallFailed) and failed.status is Status.INTERNAL
    big = open_call({}, Codecs(), 100)
    assert isinstance(big, NativeCall)
    [failed] = big.reader.receive_data(frame(b"x" * 101)[:5])  # the header alone says too large
    assert isinstance(failed, CallFailed) and failed.status is Status.RESOURCE_EXHAUSTED


def test_response_headers_frames_and_trailers() -> None:
    call = _open(grpc_accept_encoding=b"gzip, identity")
    w = call.writer
    assert w.headers() == [(b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"zstd,gzip,identity"),
                           (b"grpc-encoding", b"gzip")]
    assert w.message(b"tiny") == frame(b"tiny")  # would not shrink: flag 0
    packed = w.message(b"a" * 500)
    assert packed[0] == 1 and CODECS["gzip"].decompress(packed[5:], 1000) == b"a" * 500
    assert w.trailers(Status.OK) == [(b"grpc-status", b"0")]
    assert w.trailers(Status.RESOURCE_EXHAUSTED, "slow down: 100%\n", [("Retry-After", "2")]) == [
        (b"grpc-status", b"8"), (b"grpc-message", b"slow down: 100%25%0A"), (b"retry-after", b"2")]
    assert _open().writer.headers()[-1] == (b"grpc-accept-encoding", b"zstd,gzip,identity")  # identity: no header


def test_an_encoding_we_do_not_offer_is_rejected_with_the_list() -> None:
    opened = open_call({b"grpc-encoding": b"snappy"}, Codecs(), 1 << 16)
    assert isinstance(opened, NativeRejection) and opened.status is Status.UNIMPLEMENTED
    assert "snappy" in opened.message and "zstd,gzip,identity" in opened.message
    assert (b"grpc-accept-encoding", b"zstd,gzip,identity") in opened.writer.headers()
    assert opened.writer.trailers(opened.status, opened.message)[0] == (b"grpc-status", b"12")


def test_content_types() -> None:
    assert is_grpc(b"application/grpc") and is_grpc(b"Application/GRPC+proto; charset=x")
    assert not is_grpc(b"application/grpc-web") and not is_grpc(b"application/grpc+json") and not is_grpc(b"")
