"""gRPC status mapping of the one error model, grpc-timeout and grpc-message encoding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import APIError, error_headers, from_wire_code
from gateway.grpc.status import (
    Status,
    decode_grpc_message,
    encode_grpc_message,
    grpc_status,
    parse_grpc_timeout,
    retry_trailers,
)


@pytest.mark.parametrize(("http", "expected"), [
    (400, Status.INVALID_ARGUMENT),
    (401, Status.UNAUTHENTICATED),
    (403, Status.PERMISSION_DENIED),
    (404, Status.NOT_FOUND),
    (413, Status.RESOURCE_EXHAUSTED),
    (429, Status.RESOURCE_EXHAUSTED),
    (499, Status.CANCELLED),
    (500, Status.INTERNAL),
    (501, Status.UNIMPLEMENTED),
    (502, Status.UNAVAILABLE),
    (503, Status.UNAVAILABLE),
    (504, Status.DEADLINE_EXCEEDED),
    (418, Status.INVALID_ARGUMENT),  # other 4xx: the request is at fault
    (507, Status.INTERNAL),  # other 5xx
    (302, Status.UNKNOWN),
])
def test_http_status_maps_to_grpc_code(http: int, expected: Status) -> None:
    assert grpc_status(APIError(http, "m")) is expected


@pytest.mark.parametrize(("wire", "expected"), [
    (1, Status.INTERNAL), (2, Status.INVALID_ARGUMENT), (3, Status.NOT_FOUND), (4, Status.UNAVAILABLE),
    (5, Status.CANCELLED), (6, Status.INVALID_ARGUMENT), (7, Status.UNAVAILABLE), (8, Status.UNAVAILABLE),
    (9, Status.UNAVAILABLE), (10, Status.DEADLINE_EXCEEDED),
])
def test_worker_error_codes_reach_grpc_through_the_one_model(wire: int, expected: Status) -> None:
    assert grpc_status(from_wire_code(wire, "x")) is expected


def test_retry_after_becomes_a_trailer() -> None:
    assert retry_trailers(APIError(429, "slow down", retry_after=1.5)) == [("retry-after", "2")]
    assert retry_trailers(APIError(400, "bad")) == []


@pytest.mark.parametrize(("wait", "seconds"), [(1.2, "2"), (2.5, "3"), (0.2, "1"), (0.0, "1"), (3.0, "3")])
def test_retry_after_trailer_rounds_up_as_the_http_header_does(wait: float, seconds: str) -> None:
    """A client told 1 for a 1.2 s wait retries too early and is refused again (issue #27)."""
    err = APIError(429, "slow down", retry_after=wait)
    assert retry_trailers(err) == [("retry-after", seconds)]
    assert dict(error_headers(err))[b"retry-after"] == seconds.encode()


@pytest.mark.parametrize(("value", "seconds"), [
    ("1H", 3600.0), ("2M", 120.0), ("30S", 30.0), ("250m", 0.25), ("1500u", 0.0015),
    ("100n", 1e-7), (b"99999999S", 99999999.0), ("0m", 0.0),
])
def test_grpc_timeout_units(value: str | bytes, seconds: float) -> None:
    assert parse_grpc_timeout(value) == seconds


@pytest.mark.parametrize("value", [
    "", "S", "10", "123456789S", "10s", "10 S", " 10S", "10S\n", "-1S", "1.5S", "١S", "10SS",
])
def test_malformed_grpc_timeout_raises(value: str) -> None:
    """(A call answers it INTERNAL: tests/integration/test_grpc_abuse.py.)"""
    with pytest.raises(APIError) as info:
        parse_grpc_timeout(value)
    assert info.value.param == "grpc-timeout"


@given(st.integers(0, 99_999_999), st.sampled_from([("H", 3600, 1), ("M", 60, 1), ("S", 1, 1),
                                                      ("m", 1, 10**3), ("u", 1, 10**6), ("n", 1, 10**9)]))
def test_grpc_timeout_any_value(n: int, unit: tuple[str, int, int]) -> None:
    name, mul, div = unit
    assert parse_grpc_timeout(f"{n}{name}") == n * mul / div


@given(st.text())
def test_grpc_message_percent_encoding_round_trips_in_printable_ascii(text: str) -> None:
    encoded = encode_grpc_message(text)
    assert all(0x20 <= ord(c) <= 0x7E for c in encoded)
    assert decode_grpc_message(encoded) == text
