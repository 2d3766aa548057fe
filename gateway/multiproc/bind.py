"""The supervisor's half of sharing listeners: every port bound once per gateway process, port 0
resolved once, the Unix socket bound once for all, the QUIC group steered by connection ID."""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field

from .steering import attach_steering

__all__ = ["ListenerGroups", "bind_group"]


def bind_group(kind: str, host: str, port: int, n: int, backlog: int = 1024) -> list[socket.socket]:
    """``n`` sockets on one port with SO_REUSEPORT (``kind`` "tcp": listening; "udp"), in order."""
    stype = socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=stype, flags=socket.AI_PASSIVE)[0]
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, stype)
            socks.append(s)
            if kind == "tcp":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr if len(socks) == 1 else (addr[0], socks[0].getsockname()[1], *addr[2:]))
            if kind == "tcp":
                s.listen(backlog)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


@dataclass(slots=True)
class ListenerGroups:
    """Every listener of ``[server]``/``[quic]``/``[grpc]``, bound for ``n`` processes: the resolved
    ports (for the processes' flags) and, per process, the (kind, port or path, fd) it inherits."""

    n: int
    ports: dict[str, int] = field(default_factory=dict)  # "port", "tls_port", "quic_port", "grpc_port"
    unix_path: str = ""
    warnings: list[str] = field(default_factory=list)
    _groups: list[tuple[str, int | str, list[socket.socket]]] = field(default_factory=list)

    def bind(self, name: str, kind: str, host: str, port: int) -> int:
        socks = bind_group(kind, host, port, self.n)
        bound = int(socks[0].getsockname()[1])
        self.ports[name] = bound
        self._groups.append((kind, bound, socks))
        if kind == "udp" and self.n > 1:
            try:
                attach_steering(socks[0], self.n)
            except OSError as e:  # a kernel (or sandbox) without classic BPF on reuseport groups
                self.warnings.append(f"QUIC is not steered by connection ID ({e}): a connection whose "
                                     "address changes may reach another process and be lost")
        return bound

    def bind_unix(self, path: str, backlog: int = 1024) -> None:
        if os.path.exists(path):
            with socket.socket(socket.AF_UNIX) as probe:
                if probe.connect_ex(path) != 0:
                    os.unlink(path)  # a stale file from a process that died (a live one: bind says so)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.listen(backlog)
        self.unix_path = path
        self._groups.append(("unix", path, [s] * self.n))  # one socket accepted on by every process

    def inherited_by(self, index: int) -> list[tuple[str, int | str, int]]:
        return [(kind, where, socks[index].fileno()) for kind, where, socks in self._groups]

    def close(self) -> None:
        for _, _, socks in self._groups:
            for s in set(socks):
                s.close()
        if self.unix_path:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
