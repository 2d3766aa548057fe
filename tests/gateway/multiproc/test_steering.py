"""The steering program on a real SO_REUSEPORT group in this process: every datagram lands on
the socket its destination connection ID names, from any source address."""

from __future__ import annotations

import os
import socket
import time

import pytest

from gateway.multiproc.bind import bind_group
from gateway.multiproc.steering import _CidRandom, attach_steering, cid_owner, reuseport_program


def _drain(socks: list[socket.socket], expect: int, timeout: float = 2.0) -> dict[int, list[bytes]]:
    got: dict[int, list[bytes]] = {i: [] for i in range(len(socks))}
    deadline = time.monotonic() + timeout
    while sum(map(len, got.values())) < expect and time.monotonic() < deadline:
        for i, s in enumerate(socks):
            try:
                got[i].append(s.recv(2048))
            except BlockingIOError:
                pass
    return got


def _short(dcid: bytes) -> bytes:
    return bytes([0x40]) + dcid + os.urandom(20)


def _long(dcid: bytes, packet_type: int = 0) -> bytes:
    return bytes([0xC0 | packet_type << 4]) + (1).to_bytes(4, "big") + bytes([len(dcid)]) + dcid + b"\x08" + os.urandom(30)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_datagrams_reach_the_process_their_connection_id_names(n: int) -> None:
    socks = bind_group("udp", "127.0.0.1", 0, n)
    try:
        attach_steering(socks[0], n)
        for s in socks:
            s.setblocking(False)
        port = socks[0].getsockname()[1]
        sent: list[tuple[bytes, int]] = []
        for k in range(n):
            cid = _CidRandom(k).urandom(8)
            assert cid_owner(cid) == k and cid[0] == 7  # QUIC-LB: config 0, length 8 - 1
            for _ in range(4):  # each from a new source port: NAT rebinding
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
                    for pkt in (_short(cid), _long(cid, 2)):  # 1-RTT and Handshake
                        c.sendto(pkt, ("127.0.0.1", port))
                        sent.append((pkt, k))
        # a client's own DCID (first flight): every copy, from any address, to the process its octet names
        client_dcid = os.urandom(8)
        for _ in range(6):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as c:
                pkt = _long(client_dcid, 0)
                c.sendto(pkt, ("127.0.0.1", port))
                sent.append((pkt, client_dcid[1] % n))
        got = _drain(socks, len(sent))
        for pkt, k in sent:
            assert pkt in got[k], f"a datagram for process {k} went elsewhere"
    finally:
        for s in socks:
            s.close()


def test_the_program_is_small_and_ends_in_returns() -> None:
    prog = reuseport_program(4)
    assert len(prog) == 10 and prog[-1][0] == 0x06 and prog[-2][0] == 0x16
    for i, (code, jt, jf, _) in enumerate(prog):  # every jump lands inside the program
        if code & 0x07 == 0x05 and code != 0x05:
            assert i + 1 + max(jt, jf) < len(prog)
