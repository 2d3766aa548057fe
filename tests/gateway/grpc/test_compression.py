"""grpc-encoding negotiation and message compression (zstd, gzip)."""

from __future__ import annotations

import gzip
import os
import struct

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from gateway.grpc.compression import (
    Codecs,
    CorruptMessage,
    GzipCodec,
    MessageTooLarge,
    Negotiation,
    UnsupportedEncoding,
    ZstdCodec,
    encode_message,
)

CODECS = [GzipCodec(), ZstdCodec()]
TEXT = b"The quick brown fox jumps over the lazy dog. " * 20


def _unframe(frame: bytes) -> tuple[int, bytes]:
    flags, length = struct.unpack(">BI", frame[:5])
    assert length == len(frame) - 5
    return flags, frame[5:]


def test_identity_or_absent_encoding_needs_no_codec() -> None:
    codecs = Codecs()
    assert codecs.negotiate(None, None) == Negotiation(None, None)
    assert codecs.negotiate("identity", "identity") == Negotiation(None, None)


def test_request_encoding_and_preferred_response_encoding() -> None:
    nego = Codecs().negotiate("gzip", "identity, gzip ,zstd")
    assert isinstance(nego, Negotiation)
    assert nego.request is not None and nego.request.name == "gzip"
    assert nego.response is not None and nego.response.name == "zstd"  # zstd preferred when offered
    only_gzip = Codecs().negotiate("zstd", "gzip")
    assert isinstance(only_gzip, Negotiation) and only_gzip.response is not None
    assert only_gzip.response.name == "gzip"


def test_response_stays_identity_unless_the_client_accepts_a_codec() -> None:
    nego = Codecs().negotiate("zstd", None)
    assert isinstance(nego, Negotiation) and nego.response is None
    nego = Codecs().negotiate(None, "deflate,snappy")
    assert isinstance(nego, Negotiation) and nego.response is None


def test_unknown_request_encoding_is_unsupported_with_the_accepted_list() -> None:
    got = Codecs().negotiate("snappy", "zstd")
    assert isinstance(got, UnsupportedEncoding)
    assert got.accept == "zstd,gzip,identity"
    assert "snappy" in got.message and "zstd,gzip,identity" in got.message


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_compressible_message_is_compressed_and_round_trips(codec: GzipCodec | ZstdCodec) -> None:
    flags, payload = _unframe(encode_message(TEXT, codec))
    assert flags == 1 and len(payload) < len(TEXT)
    assert codec.decompress(payload, len(TEXT)) == TEXT


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_message_that_would_not_shrink_goes_uncompressed(codec: GzipCodec | ZstdCodec) -> None:
    noise = os.urandom(200)
    assert encode_message(noise, codec) == b"\x00" + struct.pack(">I", 200) + noise
    assert encode_message(b"hi", codec) == b"\x00\x00\x00\x00\x02hi"


@given(st.binary(max_size=400), st.sampled_from(CODECS))
def test_compression_never_makes_a_message_larger(payload: bytes, codec: GzipCodec | ZstdCodec) -> None:
    frame = encode_message(payload, codec)
    assert len(frame) <= 5 + len(payload)
    flags, body = _unframe(frame)
    assert (codec.decompress(body, len(payload)) if flags else body) == payload


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_codec_overhead_is_a_lower_bound(codec: GzipCodec | ZstdCodec) -> None:
    # Messages up to `overhead` bytes are never tried; that is only right if none could shrink.
    assert min(len(codec.compress(b"a" * n)) for n in range(0, 64)) > codec.overhead


def test_levels_reach_the_compressor() -> None:
    assert ZstdCodec(19).compress(TEXT) == zstandard.ZstdCompressor(level=19).compress(TEXT)
    assert gzip.decompress(GzipCodec(1).compress(TEXT)) == TEXT
    assert len(GzipCodec(9).compress(TEXT)) <= len(GzipCodec(1).compress(TEXT))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_inflating_past_the_limit_is_too_large(codec: GzipCodec | ZstdCodec) -> None:
    bomb = codec.compress(b"\0" * 1_000_000)
    assert len(bomb) < 2000
    with pytest.raises(MessageTooLarge):
        codec.decompress(bomb, 4096)
    assert codec.decompress(codec.compress(b"\0" * 4096), 4096) == b"\0" * 4096


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_corrupt_data_is_corrupt(codec: GzipCodec | ZstdCodec) -> None:
    good = codec.compress(TEXT)
    for bad in (b"not compressed at all", good[: len(good) // 2]):
        with pytest.raises(CorruptMessage):
            codec.decompress(bad, 10_000)


def test_gzip_trailing_bytes_are_corrupt() -> None:
    with pytest.raises(CorruptMessage):
        GzipCodec().decompress(GzipCodec().compress(TEXT) + b"junk", 10_000)


def test_messages_up_to_min_size_are_not_tried() -> None:
    codecs = Codecs(min_size=64)
    gz = codecs.negotiate("identity", "gzip").response
    assert gz is not None and gz.min_size == 64
    small, large = b"a" * 64, b"a" * 65  # both compressible: only the larger one is tried
    assert _unframe(encode_message(small, gz)) == (0, small)
    flags, body = _unframe(encode_message(large, gz))
    assert flags == 1 and gz.decompress(body, 65) == large
    assert Codecs(min_size=0).negotiate(None, "zstd").response.min_size == ZstdCodec.overhead  # type: ignore[union-attr]
