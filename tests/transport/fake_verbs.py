"""Test double of the slice of pyverbs that ``transport.rdma.RdmaChannel`` uses.

Two :class:`FakeCMID` objects joined with :func:`pair` behave like a connected
RC queue pair: a SEND lands in the peer's oldest posted receive (and fails
loudly if none is posted, as an RNR would), completions queue on the CQ
given to ``create_qp``, and an armed CQ signals its completion channel by
making a real pipe fd readable, so the event-loop wiring is exercised.
"""

from __future__ import annotations

import os
from collections import deque
from types import SimpleNamespace
from typing import Any

IBV_WC_SUCCESS = 0
IBV_WC_SEND = 0
IBV_WC_RECV = 128


class FakeCompChannel:
    def __init__(self, ctx: object) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)

    def signal(self) -> None:
        os.write(self._w, b"e")

    def get_cq_event(self, cq: FakeCQ) -> None:
        os.read(self.fd, 1)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._w)


class FakeCQ:
    def __init__(
        self, ctx: object, cqe: int, cq_context: object, channel: FakeCompChannel, vector: int
    ) -> None:
        self.channel = channel
        self.cqe = cqe
        self.wcs: deque[SimpleNamespace] = deque()
        self.armed = False

    def push(self, wc: SimpleNamespace) -> None:
        self.wcs.append(wc)
        assert len(self.wcs) <= self.cqe, "CQ overrun"
        if self.armed:
            self.armed = False
            self.channel.signal()

    def req_notify(self) -> None:
        self.armed = True

    def ack_events(self, n: int) -> None:
        pass

    def poll(self, n: int) -> tuple[int, list[SimpleNamespace]]:
        out = [self.wcs.popleft() for _ in range(min(n, len(self.wcs)))]
        return len(out), out


class FakeMR:
    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)

    def write(self, data: bytes, length: int, offset: int = 0) -> None:
        self.buf[offset : offset + length] = data[:length]

    def read(self, length: int, offset: int) -> bytes:
        return bytes(self.buf[offset : offset + length])


class FakeCMID:
    def __init__(self) -> None:
        self.context = object()
        self.peer: FakeCMID | None = None
        self.cq: FakeCQ | None = None
        self.max_recv = 0
        self.posted: deque[tuple[FakeMR, int]] = deque()
        self.sends = 0
        self.closed = False

    def create_qp(self, init: SimpleNamespace) -> None:
        assert init.scq is init.rcq
        self.cq = init.scq
        self.max_recv = init.cap.max_recv_wr

    def reg_msgs(self, size: int) -> FakeMR:
        return FakeMR(size)

    def post_recv(self, mr: FakeMR, length: int) -> None:
        assert len(self.posted) < self.max_recv, "more receives posted than the QP holds"
        self.posted.append((mr, length))

    def post_send(self, mr: FakeMR, flags: int, length: int) -> None:
        peer = self.peer
        assert peer is not None and peer.cq is not None and self.cq is not None
        assert peer.posted, "RNR: SEND with no receive posted at the peer"
        rmr, rlen = peer.posted.popleft()
        assert length <= rlen
        rmr.buf[:length] = mr.buf[:length]
        self.sends += 1
        peer.cq.push(SimpleNamespace(status=IBV_WC_SUCCESS, opcode=IBV_WC_RECV, byte_len=length))
        self.cq.push(SimpleNamespace(status=IBV_WC_SUCCESS, opcode=IBV_WC_SEND, byte_len=length))

    def disconnect(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def pair() -> tuple[FakeCMID, FakeCMID]:
    a, b = FakeCMID(), FakeCMID()
    a.peer, b.peer = b, a
    return a, b


def _ns(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(**kw)


VERBS = SimpleNamespace(
    cq=SimpleNamespace(CompChannel=FakeCompChannel, CQ=FakeCQ),
    qp=SimpleNamespace(QPCap=_ns, QPInitAttr=_ns),
    enums=SimpleNamespace(IBV_QPT_RC=2, IBV_WC_SUCCESS=IBV_WC_SUCCESS, IBV_WC_RECV=IBV_WC_RECV),
)
