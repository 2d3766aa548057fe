"""The HTTP/2 frame guard, bytes in: header blocks limited as they accumulate, rapid resets and
cheap frames budgeted; the same verdict at the same frame whatever the split of the input."""

from __future__ import annotations

import h2.config
import h2.connection
from hyperframe.frame import (
    ContinuationFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    WindowUpdateFrame,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.http.h2_guard import GuardLimits, H2FrameGuard

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
LIMITS = GuardLimits(max_header_bytes=1000, reset_allowance=10, reset_ratio=2.0, frame_rate=100.0,
                     frame_burst=50.0)


def _client_requests(n: int) -> bytes:
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    for _ in range(n):
        c.send_headers(c.get_next_available_stream_id(), [(":method", "GET"), (":path", "/"), (":scheme", "http"),
                                                          (":authority", "x")], end_stream=True)
    return c.data_to_send()


def _flood(frames: int, size: int = 400) -> bytes:
    out = PREFACE + HeadersFrame(1, data=b"\x00" * size).serialize()  # no END_HEADERS
    return out + b"".join(ContinuationFrame(1, data=b"\x00" * size).serialize() for _ in range(frames))


def _first_violation(data: bytes, cuts: list[int], now: float = 0.0) -> tuple[int, str] | None:
    """Feed ``data`` split at ``cuts``; where (bytes fed) and why the guard first objects."""
    g = H2FrameGuard(LIMITS, 0.0)
    fed = 0
    bounds = sorted({c for c in cuts if 0 < c < len(data)}) + [len(data)]
    start = 0
    for end in bounds:
        v = g.feed(data[start:end], now)
        fed = end
        if v is not None:
            return fed, v.reason
        start = end
    return None


def test_normal_requests_pass() -> None:
    assert _first_violation(_client_requests(40), []) is None


def test_a_continuation_flood_is_cut_at_the_first_frame_past_the_limit() -> None:
    data = _flood(100)
    g = H2FrameGuard(LIMITS, 0.0)
    frame = 9 + 400
    for i in range(100):
        v = g.feed(data[: 24 + frame] if i == 0 else data[24 + frame * i: 24 + frame * (i + 1)], 0.0)
        if v is not None:
            break
    assert v is not None and v.header_flood
    assert (i + 1) * 400 > 1000 >= i * 400  # the frame that crossed the limit, not later


def test_a_block_that_ends_resets_the_count() -> None:
    ok = PREFACE + b"".join(
        HeadersFrame(sid, data=b"\x00" * 600, flags=["END_HEADERS"]).serialize() for sid in range(1, 40, 2))
    assert _first_violation(ok, []) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_any_split_gives_the_same_verdict(cuts: list[int]) -> None:
    data = _flood(8)
    whole = _first_violation(data, [])
    split = _first_violation(data, cuts)
    assert whole is not None and split is not None and whole[1] == split[1]


def test_rapid_reset_past_the_allowance_outpacing_completions() -> None:
    g = H2FrameGuard(LIMITS, 0.0)
    g.feed(PREFACE, 0.0)
    for i in range(10):  # within the allowance
        assert g.feed(RstStreamFrame(2 * i + 1, error_code=8).serialize(), i * 0.1) is None
    for _ in range(10):
        g.stream_completed()
    for i in range(10, 20):  # 20 resets against 10 completed: allowed (ratio 2)
        assert g.feed(RstStreamFrame(2 * i + 1, error_code=8).serialize(), i * 0.1) is None
    v = g.feed(RstStreamFrame(41, error_code=8).serialize(), 2.1)
    assert v is not None and "reset" in v.reason


def test_cheap_frames_draw_on_a_bucket() -> None:
    g = H2FrameGuard(LIMITS, 0.0)
    g.feed(PREFACE, 0.0)
    ping = PingFrame(0, opaque_data=b"12345678").serialize()
    for _ in range(50):
        assert g.feed(ping, 0.0) is None
    assert g.feed(ping, 0.0) is not None  # the burst is spent
    g2 = H2FrameGuard(LIMITS, 0.0)
    g2.feed(PREFACE, 0.0)
    for i in range(500):  # at the sustained rate: never
        assert g2.feed(ping, i / 100.0) is None


def test_a_busy_client_acknowledging_each_response_is_not_a_flood() -> None:
    """Three WINDOW_UPDATEs per completed stream, at 10x the flat rate in streams a second: each
    stream's credit covers its acknowledgements, so it runs for ever; the same frames with no
    completed streams are closed within the burst."""
    update = WindowUpdateFrame(0, window_increment=65535).serialize()
    busy = H2FrameGuard(LIMITS, 0.0)
    busy.feed(PREFACE, 0.0)
    for i in range(3000):  # 1000 streams a second (LIMITS.frame_rate is 100 frames a second)
        busy.stream_completed()
        assert busy.feed(update * 3, i / 1000.0) is None
    idle = H2FrameGuard(LIMITS, 0.0)
    idle.feed(PREFACE, 0.0)
    assert any(idle.feed(update * 3, i / 1000.0) is not None for i in range(3000))


def test_a_goaway_flood_draws_on_the_same_bucket() -> None:
    g = H2FrameGuard(LIMITS, 0.0)
    g.feed(PREFACE, 0.0)
    goaway = GoAwayFrame(0, last_stream_id=0, error_code=0).serialize()
    for _ in range(50):
        assert g.feed(goaway, 0.0) is None
    assert g.feed(goaway, 0.0) is not None
