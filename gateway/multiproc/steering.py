"""QUIC by connection ID across gateway processes: connection IDs that name their process, and the
classic BPF program that steers each datagram to that process's socket.

How it works: every process has its own UDP socket in one SO_REUSEPORT group, bound by the
supervisor in process order (so socket ``k`` of the group is process ``k``'s, and stays so: the
supervisor keeps its copies open while a process restarts). A connection ID the server issues is
QUIC-LB's plaintext form (draft-ietf-quic-load-balancers): a first octet (config rotation 0, the
length self-encoded), then the server ID -- here the process index, one octet -- then random
bytes. The program (``SO_ATTACH_REUSEPORT_CBPF``: no eBPF toolchain, no privilege) reads the
destination connection ID's second octet from the UDP payload (a long header's DCID starts at
offset 6, a short header's at 1) and returns it modulo the number of processes as the socket
index (a long header whose DCID is shorter than two octets falls back to the kernel's 4-tuple
hash; a datagram too short to read goes to process 0, which drops it). So every packet of a connection reaches its owner whatever
the client's address (NAT rebinding, migration), and every packet under a client-chosen DCID --
a first flight's Initial and 0-RTT packets, and any copy of them from any address -- reaches one
process, the one that random octet names: Initials spread over all processes, and a replayed
first flight meets the original's connection (aioquic drops its packets as duplicates) or, once
that is gone, its claimed ticket.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from typing import Any

__all__ = ["SERVER_ID_OFFSET", "reuseport_program", "attach_steering", "install_cid_owner", "cid_owner"]

SO_ATTACH_REUSEPORT_CBPF = 51
SERVER_ID_OFFSET = 1  # octet of the connection ID that names its process
_CID_LENGTH = 8  # aioquic's connection_id_length
_FIRST_OCTET = _CID_LENGTH - 1  # config rotation 0 (top 3 bits), the length self-encoded (low 5 bits)

# classic BPF opcodes (linux/filter.h)
_LDB_ABS, _JSET, _JGE, _JA, _MOD_K, _RET_K, _RET_A = 0x30, 0x45, 0x35, 0x05, 0x94, 0x06, 0x16
_FALLBACK = 0xFFFFFFFF  # any index >= the group's size: the kernel hashes the 4-tuple


def reuseport_program(processes: int) -> list[tuple[int, int, int, int]]:
    """The steering program as (code, jt, jf, k) instructions; jumps count from the next one."""
    return [
        (_LDB_ABS, 0, 0, 0),  # 0: A = first octet
        (_JSET, 0, 4, 0x80),  # 1: long header? -> 2, else short -> 6
        (_LDB_ABS, 0, 0, 5),  # 2: A = DCID length
        (_JGE, 0, 5, 2),  # 3: at least 2 octets -> 4, else fall back (9)
        (_LDB_ABS, 0, 0, 6 + SERVER_ID_OFFSET),  # 4: A = DCID[1]
        (_JA, 0, 0, 1),  # 5: -> 7
        (_LDB_ABS, 0, 0, 1 + SERVER_ID_OFFSET),  # 6: short header: A = DCID[1]
        (_MOD_K, 0, 0, processes),  # 7: A %= processes (a server-issued CID: its process's index)
        (_RET_A, 0, 0, 0),  # 8: that process's socket
        (_RET_K, 0, 0, _FALLBACK),  # 9: the kernel's hash
    ]


def attach_steering(sock: socket.socket, processes: int) -> None:
    """Attach the program to ``sock``'s SO_REUSEPORT group (after every socket of it is bound)."""
    prog = reuseport_program(processes)
    filters = (ctypes.c_uint8 * (8 * len(prog))).from_buffer_copy(
        b"".join(struct.pack("HBBI", *ins) for ins in prog))
    fprog = struct.pack("HP", len(prog), ctypes.addressof(filters))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)


def cid_owner(cid: bytes) -> int:
    """The process a connection ID names (its server ID octet)."""
    return cid[SERVER_ID_OFFSET]


class _CidRandom:
    """Stands in for the ``os`` module inside aioquic's connection module: connection IDs (the
    only 8-byte draws there besides path challenges, which may carry it too) name this process."""

    def __init__(self, index: int) -> None:
        self._tail = bytes([_FIRST_OCTET, index])

    def urandom(self, n: int) -> bytes:
        if n == _CID_LENGTH:
            return self._tail + os.urandom(n - 2)
        return os.urandom(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def install_cid_owner(index: int) -> None:
    """Make every connection ID this process's QUIC server issues name process ``index``."""
    from aioquic.asyncio import server as aioquic_server
    from aioquic.quic import connection as aioquic_connection

    shim = _CidRandom(index)
    setattr(aioquic_connection, "os", shim)  # host CIDs (the first and NEW_CONNECTION_ID's)  # noqa: B010
    setattr(aioquic_server, "os", shim)  # Retry source CIDs  # noqa: B010
