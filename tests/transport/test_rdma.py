"""RDMA: the sans-I/O credit ring (here), device listing, and a real-device test (marked)."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.rdma import CreditRing, RingError, list_devices


class Side:
    """One end of a simulated RC connection: a ring plus its posted receive FIFO."""

    def __init__(self, depth: int, slot: int) -> None:
        self.ring = CreditRing(depth, slot)
        self.posted: deque[int] = deque(self.ring.initial_recvs())
        self.in_flight_sends: deque[int] = deque()
        self.received = bytearray()
        self.max_posted_used = 0


def send(a: Side, wire: deque[bytes]) -> None:
    for slot, msg in a.ring.poll_sends():
        assert len(msg) <= a.ring.slot_size
        a.in_flight_sends.append(slot)
        wire.append(msg)


def deliver(b: Side, wire: deque[bytes], a: Side) -> None:
    """One message lands at ``b``: it needs a posted receive (else the HCA would RNR)."""
    msg = wire.popleft()
    assert b.posted, "receiver not ready: the credit scheme let a send outrun the receives"
    slot = b.posted.popleft()
    b.received += b.ring.on_recv(slot, msg)
    a.ring.on_send_complete(a.in_flight_sends.popleft())


def repost(b: Side) -> None:
    b.posted.extend(b.ring.take_reposts())


@settings(
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=150,
    deadline=None,
)
@given(
    st.integers(2, 6),
    st.lists(
        st.tuples(st.sampled_from(["qa", "qb", "sa", "sb", "da", "db", "ra", "rb"]), st.integers(1, 50)),
        max_size=120,
    ),
)
def test_ring_delivers_everything_in_order_without_rnr_or_deadlock(
    depth: int, ops: list[tuple[str, int]]
) -> None:
    a, b = Side(depth, 16), Side(depth, 16)
    ab: deque[bytes] = deque()
    ba: deque[bytes] = deque()
    sent_a = bytearray()
    sent_b = bytearray()
    counter = 0
    for op, n in ops:
        if op == "qa":
            data = bytes((counter + i) % 251 for i in range(n))
            counter += n
            a.ring.queue(data)
            sent_a += data
        elif op == "qb":
            data = bytes((counter * 7 + i) % 253 for i in range(n))
            counter += n
            b.ring.queue(data)
            sent_b += data
        elif op == "sa":
            send(a, ab)
        elif op == "sb":
            send(b, ba)
        elif op == "da" and ab:
            deliver(b, ab, a)
        elif op == "db" and ba:
            deliver(a, ba, b)
        elif op == "ra":
            repost(a)
        elif op == "rb":
            repost(b)
        assert 0 <= a.ring.credits <= depth and 0 <= b.ring.credits <= depth
    # Then run to quiescence like the event-driven adapter would: must finish.
    for _ in range(10_000):
        repost(a)
        repost(b)
        send(a, ab)
        send(b, ba)
        if not ab and not ba:
            break
        while ab:
            deliver(b, ab, a)
        while ba:
            deliver(a, ba, b)
    assert not ab and not ba
    assert bytes(b.received) == bytes(sent_a)
    assert bytes(a.received) == bytes(sent_b)
    assert a.ring.pending_bytes == 0 and b.ring.pending_bytes == 0


def test_one_way_stream_keeps_flowing_with_credit_returns() -> None:
    """Only A sends; B must return credits on its own (credit-only messages)."""
    a, b = Side(4, 32), Side(4, 32)
    ab: deque[bytes] = deque()
    ba: deque[bytes] = deque()
    payload = bytes(range(256)) * 20
    a.ring.queue(payload)
    for _ in range(1000):
        send(a, ab)
        while ab:
            deliver(b, ab, a)
        repost(b)
        send(b, ba)
        while ba:
            deliver(a, ba, b)
        repost(a)
        if not a.ring.pending_bytes:
            break
    assert bytes(b.received) == payload


def test_ring_rejects_a_misbehaving_peer() -> None:
    r = CreditRing(2, 16)
    with pytest.raises(RingError):
        r.on_recv(0, b"\x00")  # shorter than the header
    with pytest.raises(RingError):
        r.on_recv(0, b"\x09\x00\x00\x00")  # returns credits never given
    with pytest.raises(RingError):
        r.on_recv(0, b"\x00\x00\x80\x00")  # unknown flag
    with pytest.raises(RingError):
        r.on_recv(0, b"\x00\x00\x01\x00x")  # credit-only with payload
    r2 = CreditRing(2, 16)
    for i in range(2):
        r2.on_recv(i, b"\x00\x00\x00\x00x")
    with pytest.raises(RingError):
        r2.on_recv(2, b"\x00\x00\x00\x00x")  # a third data message on 2 credits
    with pytest.raises(RingError):
        r.on_send_complete(0)  # slot not in flight
    with pytest.raises(ValueError):
        CreditRing(1, 16)


def test_list_devices_reads_sysfs(tmp_path: Path) -> None:
    assert list_devices(str(tmp_path / "missing")) == []
    hw = tmp_path / "mlx5_0"
    (hw / "ports" / "1").mkdir(parents=True)
    (hw / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    (hw / "device").mkdir()
    rxe = tmp_path / "rxe0"
    (rxe / "ports" / "1").mkdir(parents=True)
    (rxe / "ports" / "1" / "state").write_text("1: DOWN\n")
    devs = {d.name: d for d in list_devices(str(tmp_path))}
    assert not devs["mlx5_0"].soft and devs["mlx5_0"].active
    assert devs["rxe0"].soft and not devs["rxe0"].active


def _has_active_device() -> bool:
    return any(d.active for d in list_devices())


@pytest.mark.rdma
@pytest.mark.skipif(not _has_active_device(), reason="no active RDMA device on this machine")
async def test_real_rdma_round_trip() -> None:  # pragma: no cover - needs hardware or rxe
    import os
    import socket

    from tests.transport.doubles import EchoWorker
    from transport.client import connect
    from transport.messages import SamplingParams, Submit
    from transport.server import serve

    # rdma_cm binds by IP: use an address of the RDMA netdev (loopback has no device).
    host = os.environ.get("QUICSERVE_RDMA_HOST") or socket.gethostbyname(socket.gethostname())
    srv = await serve(f"rdma://{host}:18515", EchoWorker(), rdma_required=True)
    try:
        conn = await connect(srv.address, rdma_required=True)
        st_ = conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=300), prompt="x"))
        n = 0
        async with asyncio.timeout(20):
            while True:
                try:
                    for ev in await st_.next_events():
                        n += len(getattr(ev, "token_ids", ()))
                except StopAsyncIteration:
                    break
        assert n == 300
        await conn.close()
    finally:
        await srv.close()


def _pyverbs_or_skip() -> None:
    from transport.errors import RdmaUnavailable
    from transport.rdma import import_pyverbs

    try:
        import_pyverbs()
    except RdmaUnavailable as exc:
        pytest.skip(f"pyverbs not importable here: {exc}")


def test_pyverbs_imports_from_dist_packages_and_fails_cleanly_without_device() -> None:
    """Debian's python3-pyverbs loads into the venv; with no device, setup is a ConnectError."""
    _pyverbs_or_skip()
    if any(d.active for d in list_devices()):
        pytest.skip("machine has an RDMA device")
    from transport.errors import ConnectError
    from transport.rdma import rdma_connect, rdma_listen

    async def body() -> None:
        with pytest.raises(ConnectError, match="rdma://127.0.0.1:18515"):
            await rdma_connect("127.0.0.1", 18515, lambda: None)  # type: ignore[arg-type, return-value]
        with pytest.raises(ConnectError, match="cannot listen"):
            await rdma_listen("127.0.0.1", 18515, lambda: None)  # type: ignore[arg-type, return-value]

    asyncio.run(asyncio.wait_for(body(), 20))


def test_rdma_channel_adapter_over_fake_verbs() -> None:
    """The pyverbs adapter end to end over a test-double HCA: tiny rings (depth 3, 128-byte
    slots) force chunking and credit stalls; completions arrive through a real fd on the loop."""
    from tests.transport import fake_verbs
    from tests.transport.doubles import EchoWorker
    from transport.client import ClientConnection
    from transport.flow import FlowConnection
    from transport.messages import Finish, Hello, SamplingParams, Submit, TokenEntry
    from transport.rdma import RdmaChannel
    from transport.server import WorkerServer

    async def body() -> None:
        loop = asyncio.get_running_loop()
        server = WorkerServer(EchoWorker(), "w", 1.0, 5.0)
        core = FlowConnection("gateway", Hello(initial_credit=32), loop.time())
        conn = ClientConnection(core, loop)
        cm_g, cm_w = fake_verbs.pair()
        ch_w = RdmaChannel(cm_w, CreditRing(3, 128), server._new_endpoint, verbs=fake_verbs.VERBS)
        ch_g = RdmaChannel(cm_g, CreditRing(3, 128), lambda: conn.endpoint, verbs=fake_verbs.VERBS)
        ch_w.start()
        ch_g.start()
        await asyncio.wait_for(conn._hello, 5)
        assert conn.peer_hello.identity == "w"
        streams = [
            conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=100), prompt="x"))
            for _ in range(5)
        ]
        for st_ in streams:
            toks: list[int] = []
            async with asyncio.timeout(10):
                while True:
                    try:
                        evs = await st_.next_events()
                    except StopAsyncIteration:
                        break
                    toks += [t for e in evs if isinstance(e, TokenEntry) for t in e.token_ids]
                    last = evs[-1]
            assert toks == list(range(100)) and isinstance(last, Finish)
        assert cm_g.sends > 50 and cm_w.sends > 50  # many small messages, both ways
        await conn.close()
        assert cm_g.closed

    asyncio.run(body())


def test_rdma_channel_failed_completion_ends_streams_once() -> None:
    """A work completion with an error status (e.g. the peer's QP flushed) ends the connection:
    every open stream gets CONNECTION_LOST exactly once."""
    from types import SimpleNamespace

    from tests.transport import fake_verbs
    from tests.transport.doubles import EchoWorker
    from transport.client import ClientConnection
    from transport.flow import FlowConnection
    from transport.messages import Error, ErrorCode, Hello, SamplingParams, Submit
    from transport.rdma import RdmaChannel
    from transport.server import WorkerServer

    async def body() -> None:
        loop = asyncio.get_running_loop()
        server = WorkerServer(EchoWorker(step_delay=0.005), "w", 1.0, 5.0)
        conn = ClientConnection(FlowConnection("gateway", Hello(), loop.time()), loop)
        cm_g, cm_w = fake_verbs.pair()
        RdmaChannel(cm_w, CreditRing(4, 4096), server._new_endpoint, verbs=fake_verbs.VERBS).start()
        RdmaChannel(cm_g, CreditRing(4, 4096), lambda: conn.endpoint, verbs=fake_verbs.VERBS).start()
        await asyncio.wait_for(conn._hello, 5)
        st_ = conn.submit(
            Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=10**6), prompt="x")
        )
        await st_.next_events()
        assert cm_g.cq is not None
        cm_g.cq.armed = True
        cm_g.cq.push(SimpleNamespace(status=5, opcode=fake_verbs.IBV_WC_RECV, byte_len=0))  # WR_FLUSH_ERR
        ends = []
        async with asyncio.timeout(5):
            while True:
                try:
                    ends += [e for e in await st_.next_events() if isinstance(e, Error)]
                except StopAsyncIteration:
                    break
        assert [(e.code, "status 5" in e.message) for e in ends] == [(ErrorCode.CONNECTION_LOST, True)]
        assert conn.closed and cm_g.closed

    asyncio.run(body())


@pytest.mark.parametrize("same_key", [True, False])
def test_rdma_channel_authenticates_with_the_pre_shared_key(tmp_path: Path, same_key: bool) -> None:
    """rdma:// carries no TLS; the pre-shared key's challenge rides in its HELLO exchange as on TCP: the
    right key opens the connection, another is refused before the worker names itself."""
    from tests.transport import fake_verbs
    from tests.transport.certs import write_psk
    from tests.transport.doubles import EchoWorker
    from transport.client import ClientConnection
    from transport.errors import ProtocolError
    from transport.flow import FlowConnection
    from transport.messages import Hello
    from transport.psk import read_key_file
    from transport.rdma import RdmaChannel
    from transport.security import PskKeys
    from transport.server import WorkerServer

    key = write_psk(tmp_path / "k")
    other = key if same_key else write_psk(tmp_path / "k2", "a different key, long enough too")

    async def body() -> None:
        loop = asyncio.get_running_loop()
        server = WorkerServer(EchoWorker(), "w", 1.0, 5.0, PskKeys(key))
        conn = ClientConnection(FlowConnection("gateway", Hello(), loop.time(), psk=read_key_file(other)), loop)
        cm_g, cm_w = fake_verbs.pair()
        RdmaChannel(cm_w, CreditRing(4, 4096), server._new_endpoint, verbs=fake_verbs.VERBS).start()
        RdmaChannel(cm_g, CreditRing(4, 4096), lambda: conn.endpoint, verbs=fake_verbs.VERBS).start()
        if same_key:
            await asyncio.wait_for(conn._hello, 5)
            assert conn.peer_hello.identity == "w" and conn.core.psk_verified
        else:
            with pytest.raises(ProtocolError, match="proof does not match"):
                await asyncio.wait_for(conn._hello, 5)
            assert conn.peer_hello.identity == ""
        await conn.close()

    asyncio.run(body())
