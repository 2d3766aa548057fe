"""The sans-I/O HTTP/1.1 core: bytes in, events out, the clock passed in. Fed whole, one byte
at a time and in random splits, the same input gives the same events."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import APIError
from gateway.http.common import HttpLimits
from gateway.http.h1_core import (
    BODY,
    HEADERS,
    IDLE,
    ContinueExpected,
    H1Core,
    Rejected,
    RequestReceived,
    error_response,
    response_head,
)

from .conftest import FAST_LIMITS, error_of
from .test_h1_bytes import CHUNKED, GET, HEAD, PIPELINE, POST, STREAM, UPGRADE_POST, parse_responses


def summary(events: list[Any]) -> list[tuple[Any, ...]]:
    """Events as comparable tuples (the Request inside a RequestReceived by its fields)."""
    out: list[tuple[Any, ...]] = []
    for ev in events:
        if isinstance(ev, RequestReceived):
            r = ev.request
            out.append(
                ("request", r.method, r.path, r.query, tuple(r.headers), r.body, ev.keep_alive, ev.http10)
            )
        elif isinstance(ev, Rejected):
            out.append(("rejected", ev.error.status, ev.error.message))
        else:
            assert isinstance(ev, ContinueExpected)
            out.append(("continue",))
    return out


def run(data: bytes, cuts: list[int], now: float = 0.0) -> tuple[list[tuple[Any, ...]], H1Core]:
    core = H1Core(FAST_LIMITS)
    events: list[Any] = []
    pos = 0
    for cut in sorted({c for c in cuts if 0 < c < len(data)}) + [len(data)]:
        events += core.receive(data[pos:cut], now)
        pos = cut
    return summary(events), core


EXPECT = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\nabc"
INPUTS = {
    "pipeline": PIPELINE,
    "upgrade": UPGRADE_POST,
    "expect": EXPECT + GET,
    "error-after-two": GET + POST + b"BROKEN\r\n\r\n" + GET,
    "http10": b"GET /a HTTP/1.0\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n",
    "too-large": b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    + (b"800\r\n" + b"a" * 2048 + b"\r\n") * 3
    + b"0\r\n\r\n",  # 6 KiB against FAST_LIMITS' 4 KiB
}


def test_pipeline_events() -> None:
    """Five requests, worked out by hand: two GETs, two POSTs whose bodies (one chunked) are
    "hello", a HEAD; all keep-alive HTTP/1.1."""
    events, core = run(PIPELINE, [])
    assert [(e[1], e[2], e[3], e[5], e[6], e[7]) for e in events] == [
        ("GET", "/echo", "a=1", b"", True, False),
        ("POST", "/echo", "", b"hello", True, False),
        ("POST", "/echo", "", b"hello", True, False),
        ("GET", "/stream", "n=3", b"", True, False),
        ("HEAD", "/echo", "", b"", True, False),
    ]
    assert events[0][4] == ((b"host", b"example"),)  # names lower-cased, in order
    assert core.state == IDLE and not core.closed


@pytest.mark.parametrize("name", list(INPUTS))
def test_whole_and_bytewise_agree(name: str) -> None:
    data = INPUTS[name]
    whole, _ = run(data, [])
    assert run(data, list(range(len(data))))[0] == whole
    assert whole  # every input here yields something


@settings(max_examples=60, deadline=None, database=None)
@given(st.sampled_from(sorted(INPUTS)), st.lists(st.integers(min_value=1, max_value=5000), max_size=15))
def test_any_split_gives_the_same_events(name: str, cuts: list[int]) -> None:
    data = INPUTS[name]
    assert run(data, cuts)[0] == run(data, [])[0]


def test_what_ends_the_input() -> None:
    events, core = run(INPUTS["error-after-two"], [])
    assert [e[0] for e in events] == ["request", "request", "rejected"] and events[2][1] == 400
    assert core.closed and core.receive(GET, 1.0) == []  # nothing is parsed after an error
    events, core = run(INPUTS["http10"], [])
    assert [(e[2], e[6], e[7]) for e in events] == [("/a", False, True)] and core.closed
    events, core = run(INPUTS["upgrade"], [])
    assert events[0][5] == b"hello" and events[0][6] is False and core.closed
    assert run(INPUTS["too-large"], [])[0] == [("rejected", 413, "request body exceeds 4096 bytes")]


def test_expect_100_continue_comes_before_the_body() -> None:
    core = H1Core(FAST_LIMITS)
    head, body = EXPECT[:-3], EXPECT[-3:]
    assert summary(core.receive(head, 0.0)) == [("continue",)] and core.state == BODY
    assert [e[0] for e in summary(core.receive(body, 0.0))] == ["request"]
    http10 = head.replace(b"HTTP/1.1", b"HTTP/1.0")
    assert H1Core(FAST_LIMITS).receive(http10, 0.0) == []  # 1.0 clients do not wait for it


def test_deadlines_follow_the_clock_passed_in() -> None:
    limits = HttpLimits(header_timeout=2.0, body_timeout=3.0)
    core = H1Core(limits)
    assert core.deadline == float("inf") and core.expire(1e9) is None  # between messages: none
    core.receive(b"POST /echo HTTP/1.1\r\nHost: x\r\n", 10.0)
    assert (core.state, core.deadline) == (HEADERS, 12.0)
    assert core.expire(11.9) is None
    core.receive(b"Content-Length: 4\r\n\r\nab", 11.0)
    assert (core.state, core.deadline) == (BODY, 14.0)
    core.receive(b"c", 13.5)
    assert core.deadline == 16.5  # each body byte moves the stall deadline
    expired = core.expire(16.5)
    assert expired is not None and expired.error.status == 408 and "body" in expired.error.message
    assert core.closed and core.expire(100.0) is None

    core = H1Core(limits)
    core.receive(b"GET / HTTP/1.1\r\n", 5.0)
    expired = core.expire(7.0)
    assert expired is not None and "headers" in expired.error.message


def test_client_address_and_scheme_reach_the_request() -> None:
    core = H1Core(FAST_LIMITS, scheme="https", client=("10.0.0.1", 4444))
    (ev,) = core.receive(GET, 0.0)
    assert isinstance(ev, RequestReceived)
    assert (ev.request.scheme, ev.request.client, ev.request.protocol) == (
        "https",
        ("10.0.0.1", 4444),
        "http/1.1",
    )


def test_output_framing() -> None:
    head = b"".join(response_head(200, [(b"x-a", b"1")], b"DATE", b"content-length: 2\r\n", b"\r\n"))
    assert head == b"HTTP/1.1 200 OK\r\ndate: DATE\r\nx-a: 1\r\ncontent-length: 2\r\n\r\n"
    err = APIError(503, "busy", "server_error", None, "overloaded", retry_after=1.4)
    ((status, headers, body),) = parse_responses(error_response(err, b"DATE"))
    assert status == 503 and headers[b"connection"] == b"close" and headers[b"retry-after"] == b"2"  # rounded up (errors.retry_after_value)
    assert error_of(body)["code"] == "overloaded"


def test_inputs_cover_what_the_adapter_tests_use() -> None:
    assert all(x in PIPELINE for x in (GET, POST, CHUNKED, STREAM, HEAD))
