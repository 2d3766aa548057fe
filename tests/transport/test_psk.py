"""Pre-shared-key authentication in the HELLO exchange: two cores wired in memory, fake clock."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest

from transport.flow import ConnectionEnded, Event, FlowConnection, PeerHello, SubmitReceived
from transport.messages import Auth, ErrorCode, Hello, Submit
from transport.psk import PskHandshake, read_key_file
from transport.wire import CHALLENGE_SIZE, HANDSHAKE_MAX_FRAME, HEADER, FrameDecoder, FrameEncoder, FrameType

KEY = b"0123456789abcdef0123456789abcdef"
WORKER_HELLO = Hello(role="worker", identity="w-secret", models=("tiny",), capabilities=("text",), max_batch=8)


def cores(gw_key: bytes | None, wk_key: bytes | None) -> tuple[FlowConnection, FlowConnection]:
    gw = FlowConnection("gateway", Hello(identity="gw"), 0.0, psk=gw_key)
    wk = FlowConnection("worker", WORKER_HELLO, 0.0, psk=wk_key)
    return gw, wk


def pump(gw: FlowConnection, wk: FlowConnection) -> tuple[list[Event], list[Event], list[bytes], list[bytes]]:
    """Run the exchange to quiet: (gateway events, worker events, bytes each side sent)."""
    gev: list[Event] = []
    wev: list[Event] = []
    g_sent: list[bytes] = []
    w_sent: list[bytes] = []
    while gw.has_data_to_send or wk.has_data_to_send:
        if gw.has_data_to_send:
            g_sent.append(gw.data_to_send())
            wev += wk.receive_data(g_sent[-1], 0.0)
        if wk.has_data_to_send:
            w_sent.append(wk.data_to_send())
            gev += gw.receive_data(w_sent[-1], 0.0)
    return gev, wev, g_sent, w_sent


def ended(events: list[Event]) -> ConnectionEnded:
    (end,) = [e for e in events if isinstance(e, ConnectionEnded)]
    return end


def test_same_key_authenticates_both_ways_and_the_full_hello_follows() -> None:
    gw, wk = cores(KEY, KEY)
    gev, wev, _, w_sent = pump(gw, wk)
    (ph,) = [e for e in gev if isinstance(e, PeerHello)]
    assert ph.hello.identity == "w-secret" and ph.hello.models == ("tiny",) and ph.hello.max_batch == 8
    assert any(isinstance(e, PeerHello) for e in wev)
    assert gw.psk_verified and wk.psk_verified and not gw.closed and not wk.closed
    # The worker's first frame, all an unauthenticated peer gets, is a challenge that names nothing.
    (first,) = FrameDecoder().feed(w_sent[0])[:1]
    assert isinstance(first, Hello) and len(first.challenge) == CHALLENGE_SIZE
    assert (first.identity, first.models, first.capabilities, first.max_batch) == ("", (), (), 0)
    # A request then flows as without a key.
    gw.submit(Submit(1, "tiny", prompt="x"))
    _, wev, _, _ = pump(gw, wk)
    assert [e.submit.request_id for e in wev if isinstance(e, SubmitReceived)] == [1]


@pytest.mark.parametrize(("gw_key", "wk_key", "gw_says", "wk_says"), [
    (b"another key, also long enough!!", KEY, "the worker's proof does not match", "the gateway's proof does not match"),
    (None, KEY, "the worker requires a pre-shared key and this gateway has none",
     "this worker requires a pre-shared key and the gateway offered none"),
    (KEY, None, "this gateway requires a pre-shared key and the worker offered none",
     "the gateway requires a pre-shared key and this worker has none"),
])
def test_a_missing_or_wrong_key_is_refused_on_both_sides_and_says_why(
        gw_key: bytes | None, wk_key: bytes | None, gw_says: str, wk_says: str) -> None:
    gw, wk = cores(gw_key, wk_key)
    gev, wev, _, w_sent = pump(gw, wk)
    for events, says in ((gev, gw_says), (wev, wk_says)):
        assert not any(isinstance(e, PeerHello) for e in events)
        end = ended(events)
        assert end.error.code == ErrorCode.PROTOCOL and says in end.error.message, end.error.message
    if wk_key is not None:  # a worker with a key never named itself or its models to the refused gateway
        seen = [m for chunk in w_sent for m in _lenient(chunk)]
        assert seen and all(not (isinstance(m, Hello) and (m.identity or m.models)) for m in seen)


def _lenient(data: bytes) -> list[object]:
    try:
        return list(FrameDecoder().feed(data))
    except Exception:  # noqa: BLE001 - the tail may be a frame the fresh decoder has no state for
        return []


def _forged(frames: list[object]) -> bytes:
    enc = FrameEncoder()
    return b"".join(enc.encode(m) for m in frames)  # type: ignore[arg-type]


def test_a_reflected_proof_is_refused() -> None:
    """An attacker without the key sends the worker's own challenge back, then the worker's own proof:
    the proof names the worker's role, not a gateway's."""
    wk = FlowConnection("worker", WORKER_HELLO, 0.0, psk=KEY)
    (challenge,) = FrameDecoder().feed(wk.data_to_send())
    assert isinstance(challenge, Hello)
    wk.receive_data(_forged([Hello(role="gateway", challenge=challenge.challenge)]), 0.0)
    (auth,) = FrameDecoder(max_frame=HANDSHAKE_MAX_FRAME).feed(wk.data_to_send())
    assert isinstance(auth, Auth)
    events = wk.receive_data(_forged([auth]), 0.0)
    assert "proof does not match" in ended(events).error.message and not wk.psk_verified


def test_a_recorded_proof_does_not_answer_a_new_challenge() -> None:
    gw, wk = cores(KEY, KEY)
    _, _, g_sent, _ = pump(gw, wk)
    recorded = b"".join(g_sent)  # the gateway's challenge, AUTH and full HELLO, replayed to a new worker
    wk2 = FlowConnection("worker", WORKER_HELLO, 0.0, psk=KEY)
    events = wk2.receive_data(recorded, 0.0)
    assert "proof does not match" in ended(events).error.message


def test_the_proof_is_the_documented_hmac() -> None:
    ours, theirs = b"a" * 32, b"b" * 32
    h = PskHandshake(KEY, "gateway", ours)
    proof = h.answer(theirs)
    assert proof == hmac.new(KEY, b"quicserve-psk-v1\0gateway\0" + theirs + ours, hashlib.sha256).digest()
    assert KEY not in proof and repr(h).find("0123") < 0  # the key is neither sent nor printed
    peer = PskHandshake(KEY, "worker", theirs)
    peer.answer(ours)
    assert h.check("worker", peer.answer(ours)) and not h.check("gateway", peer.answer(ours))


def test_nothing_but_the_exchange_is_accepted_before_authentication() -> None:
    wk = FlowConnection("worker", WORKER_HELLO, 0.0, psk=KEY)
    wk.data_to_send()
    events = wk.receive_data(_forged([Hello(role="gateway", challenge=b"c" * 32)]), 0.0)
    assert not events
    enc = FrameEncoder()
    submit = enc.encode(Submit(1, "tiny", prompt="x"))
    events = wk.receive_data(submit, 0.0)
    assert not any(isinstance(e, SubmitReceived) for e in events) and ended(events).error.code == ErrorCode.PROTOCOL


def test_an_unauthenticated_peer_is_held_to_small_frames_and_a_deadline() -> None:
    wk = FlowConnection("worker", WORKER_HELLO, 0.0, psk=KEY)
    big = HEADER.pack(1, FrameType.HELLO, 0, 0, HANDSHAKE_MAX_FRAME + 1)
    events = wk.receive_data(big, 0.0)
    assert "exceeds max_frame" in ended(events).error.message
    # A peer that starts and never finishes is cut at the handshake deadline, however chatty.
    wk = FlowConnection("worker", WORKER_HELLO, 0.0, psk=KEY, handshake_timeout=3.0)
    t = 0.0
    while not wk.closed and t < 20:
        wk.receive_data(b"\x01", t)  # one byte of a frame header at a time keeps it "alive"
        t += 0.5
        timer = wk.get_timer()
        assert timer is not None and timer <= 3.0
        if t >= timer:
            events = wk.handle_timer(t)
    assert wk.closed and "no complete handshake within 3s" in ended(events).error.message


def test_a_peers_refusal_before_hello_ends_the_connection_with_its_words() -> None:
    gw = FlowConnection("gateway", Hello(), 0.0)
    from transport.messages import Error

    events = gw.receive_data(FrameEncoder().encode(Error(0, ErrorCode.PROTOCOL, "this worker requires TLS")), 0.0)
    assert ended(events).error.message == "the peer refused the connection: this worker requires TLS"


def test_key_files(tmp_path: Path) -> None:
    p = tmp_path / "k"
    p.write_text(KEY.decode() + "\n")
    assert read_key_file(str(p)) == KEY
    p.write_text("short\n")
    with pytest.raises(ValueError, match="5 bytes; use at least 16") as e:
        read_key_file(str(p))
    assert "short" not in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        read_key_file(str(tmp_path / "missing"))


@pytest.mark.parametrize("key", [None, KEY])
def test_frames_coalesced_with_the_hello_get_the_limit_it_leads_to(key: bytes | None) -> None:
    """A gateway's HELLO and a SUBMIT past the handshake cap in one read: the SUBMIT is checked against
    the full frame limit, as the HELLO accepted just before it allows."""
    gw, wk = cores(key, key)
    big = Submit(1, "tiny", prompt="x" * (2 * HANDSHAKE_MAX_FRAME))
    wk_out = wk.data_to_send()
    gev = gw.receive_data(wk_out, 0.0)
    wev: list[Event] = []
    while not any(isinstance(e, PeerHello) for e in gev):  # the key's exchange, one step each way
        wev += wk.receive_data(gw.data_to_send(), 0.0)
        gev += gw.receive_data(wk.data_to_send(), 0.0)
    gw.submit(big)
    wev += wk.receive_data(gw.data_to_send(), 0.0)  # [AUTH +] full HELLO + the SUBMIT, in one piece
    assert [e.submit.prompt for e in wev if isinstance(e, SubmitReceived)] == [big.prompt] and not wk.closed
