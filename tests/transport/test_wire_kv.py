"""KV events on the wire (#29): the KV_EVENTS and KV_SUBSCRIBE frames byte for byte, the epoch and
sequence fields of HELLO and STATS (an older peer's read as "not told"), and the flow rules: events
only after a subscription, a subscription only to a worker with the capability."""

from __future__ import annotations

import struct
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.errors import WireError
from transport.flow import KV_EVENTS, ConnectionEnded, FlowConnection, KvEventsReceived, KvSubscribed
from transport.messages import Hello, KvEvents, KvSubscribe, Stats
from transport.wire import FrameDecoder, FrameEncoder, FrameType

from .test_wire import frame, mp

u64 = st.integers(0, 2**64 - 1)


def test_kv_events_frame_bytes() -> None:
    """Header (type 13, flags 0, rid 0, length), then epoch, seq, the stored count and both arrays, LE."""
    ev = KvEvents(epoch=0x0102030405060708, seq=9, stored=array("Q", [1, 2**64 - 1]), evicted=array("Q", [5]))
    data = FrameEncoder().encode(ev)
    body = (
        bytes.fromhex("0807060504030201")
        + (9).to_bytes(8, "little")
        + (2).to_bytes(4, "little")
        + (1).to_bytes(8, "little")
        + b"\xff" * 8
        + (5).to_bytes(8, "little")
    )
    assert data == struct.pack("<BBHII", 1, 13, 0, 0, len(body)) + body
    assert len(body) == 20 + 3 * 8
    (out,) = FrameDecoder().feed(data)
    assert out == ev


def test_a_full_set_has_flag_bit_0_and_evicts_nothing() -> None:
    full = KvEvents(7, 3, array("Q", [10, 11, 12]), full=True)
    data = FrameEncoder().encode(full)
    assert data[1] == FrameType.KV_EVENTS and struct.unpack_from("<H", data, 2)[0] == 1
    (out,) = FrameDecoder().feed(data)
    assert out.full and list(out.stored) == [10, 11, 12] and not out.evicted and out.seq == 3
    with pytest.raises(ValueError, match="evicts nothing"):
        FrameEncoder().encode(KvEvents(7, 3, array("Q"), array("Q", [1]), full=True))
    with pytest.raises(WireError, match="evicts nothing"):
        FrameDecoder().feed(frame(FrameType.KV_EVENTS, struct.pack("<QQIQ", 7, 3, 0, 1), flags=1))


def test_kv_subscribe_is_an_empty_frame() -> None:
    assert FrameEncoder().encode(KvSubscribe()) == frame(FrameType.KV_SUBSCRIBE)
    assert FrameDecoder().feed(frame(FrameType.KV_SUBSCRIBE)) == [KvSubscribe()]
    with pytest.raises(WireError, match="empty"):
        FrameDecoder().feed(frame(FrameType.KV_SUBSCRIBE, b"x"))


@pytest.mark.parametrize(
    "body, flags, rid, why",
    [
        (b"\0" * 19, 0, 0, "shorter"),
        (struct.pack("<QQI", 1, 1, 2) + b"\0" * 8, 0, 0, "exactly"),  # says 2 stored, carries 1
        (struct.pack("<QQI", 1, 1, 0) + b"\0" * 7, 0, 0, "exactly"),  # not whole u64s
        (struct.pack("<QQI", 1, 1, 0), 2, 0, "reserved flag"),
        (struct.pack("<QQI", 1, 1, 0), 0, 5, "request id"),
    ],
)
def test_bad_kv_events_bodies_are_protocol_errors(body: bytes, flags: int, rid: int, why: str) -> None:
    with pytest.raises(WireError, match=why):
        FrameDecoder().feed(frame(FrameType.KV_EVENTS, body, rid=rid, flags=flags))


@settings(max_examples=60, deadline=None)
@given(u64, u64, st.lists(u64, max_size=20), st.lists(u64, max_size=20), st.booleans(), st.data())
def test_round_trip_in_any_split(
    epoch: int, seq: int, stored: list[int], evicted: list[int], full: bool, data: st.DataObject
) -> None:
    ev = KvEvents(epoch, seq, array("Q", stored), array("Q", [] if full else evicted), full)
    raw = FrameEncoder().encode(ev) + FrameEncoder().encode(KvSubscribe())
    cut = data.draw(st.integers(0, len(raw)))
    dec = FrameDecoder()
    assert dec.feed(raw[:cut]) + dec.feed(raw[cut:]) == [ev, KvSubscribe()]


def test_hello_and_stats_carry_the_epoch_and_read_an_older_peers_as_zero() -> None:
    hello = Hello(
        role="worker",
        models=("tiny",),
        capabilities=(KV_EVENTS,),
        max_batch=8,
        kv_blocks=64,
        block_size=16,
        max_model_len=1024,
        model_id="tiny",
        prefix_hash="x",
        kv_epoch=2**64 - 1,
    )
    (out,) = FrameDecoder().feed(FrameEncoder().encode(hello))
    assert out == hello
    older = [1, "worker", "w", ["tiny"], [], 256, 1 << 24, 8, 64, 16, 1024, "tiny", "x", b""]  # no field 14
    (old,) = FrameDecoder().feed(frame(FrameType.HELLO, mp(older)))
    assert old.kv_epoch == 0 and old.kv_blocks == 64
    stats = Stats(1, 2, 3, 4, kv_epoch=77, kv_seq=2**63)
    (out,) = FrameDecoder().feed(FrameEncoder().encode(stats))
    assert out == stats
    counters = [1, 2, 3, 4, 0.0, b"", 0.0, 5, 0.5, 6, 0, 0.0]
    (old,) = FrameDecoder().feed(frame(FrameType.STATS, mp(counters)))  # a worker that predates KV events
    assert (old.kv_epoch, old.kv_seq, old.steps) == (0, 0, 5)
    with pytest.raises(WireError, match="all together"):
        FrameDecoder().feed(frame(FrameType.STATS, mp([*counters, 77])))  # epoch without its seq


# -- the flow rules ------------------------------------------------------------------------------


def pair(
    worker_caps: tuple[str, ...] = (KV_EVENTS,),
) -> tuple[FlowConnection, FlowConnection, list[object], list[object]]:
    gw = FlowConnection("gateway", Hello(), 0.0)
    wk = FlowConnection("worker", Hello(models=("m",), capabilities=worker_caps, kv_epoch=5), 0.0)
    gw_ev: list[object] = []
    wk_ev: list[object] = []
    pump(gw, wk, gw_ev, wk_ev)
    return gw, wk, gw_ev, wk_ev


def pump(gw: FlowConnection, wk: FlowConnection, gw_ev: list[object], wk_ev: list[object]) -> None:
    while gw.has_data_to_send or wk.has_data_to_send:
        if gw.has_data_to_send:
            wk_ev += wk.receive_data(gw.data_to_send(), 0.0)
        if wk.has_data_to_send:
            gw_ev += gw.receive_data(wk.data_to_send(), 0.0)


def test_events_flow_only_after_a_subscription() -> None:
    gw, wk, gw_ev, wk_ev = pair()
    assert gw.peer_hello is not None and gw.peer_hello.kv_epoch == 5
    with pytest.raises(ValueError, match="did not subscribe"):
        wk.send_kv_events(KvEvents(5, 0, array("Q", [1]), full=True))
    gw.subscribe_kv()
    pump(gw, wk, gw_ev, wk_ev)
    assert wk_ev[-1] == KvSubscribed()
    full = KvEvents(5, 0, array("Q", [1, 2]), full=True)
    step = KvEvents(5, 1, array("Q", [3]), array("Q", [1]))
    wk.send_kv_events(full)
    wk.send_kv_events(step)
    pump(gw, wk, gw_ev, wk_ev)
    assert [e.events for e in gw_ev if isinstance(e, KvEventsReceived)] == [full, step]


def test_unasked_events_and_a_subscription_without_the_capability_are_refused() -> None:
    gw, wk, gw_ev, _ = pair()
    gw_ev += gw.receive_data(FrameEncoder().encode(KvEvents(5, 0, array("Q"))), 0.0)  # nobody asked
    assert isinstance(gw_ev[-1], ConnectionEnded) and "may not send KvEvents" in gw_ev[-1].error.message
    gw, wk, _, wk_ev = pair(worker_caps=())
    with pytest.raises(ValueError, match="does not publish"):
        gw.subscribe_kv()
    wk_ev += wk.receive_data(FrameEncoder().encode(KvSubscribe()), 0.0)  # a gateway that asks anyway
    assert isinstance(wk_ev[-1], ConnectionEnded) and "may not send KvSubscribe" in wk_ev[-1].error.message
