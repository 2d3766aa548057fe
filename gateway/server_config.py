"""``[server]`` and ``[shutdown]``: the listeners' addresses and the drain (``quicserve serve``'s own)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ServerSettings", "ShutdownSettings"]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080  # cleartext HTTP/1.1 + h2c; 0 = any free port
    tls_port: int = 8443  # TLS with ALPN h2/http1.1; -1 disables TLS
    tls_cert: str = ""  # PEM file; empty = self-signed cert in state_dir
    tls_key: str = ""
    state_dir: str = "~/.local/state/quicserve"
    uvloop: bool = True
    unix_socket: str = ""  # also serve HTTP/1.1 + h2c on this Unix socket path ("" = none)
    reuse_port: bool = False  # SO_REUSEPORT: several gateway processes on one port (one per core)
    processes: int | str = 1  # gateway processes over one worker pool (gateway/multiproc); "auto" = one per CPU

    def process_count(self) -> int:
        """How many gateway processes ``processes`` asks for ("auto": the CPUs this process may run on)."""
        if self.processes == "auto":
            return max(1, len(os.sched_getaffinity(0)))
        return int(self.processes)

    def _validate(self, p: list[str]) -> None:
        if not (0 <= self.port <= 65535):
            p.append(f"server.port: {self.port} is not a TCP port (0..65535)")
        if not (-1 <= self.tls_port <= 65535):
            p.append(f"server.tls_port: {self.tls_port} is not a TCP port (0..65535, -1 = off)")
        if bool(self.tls_cert) != bool(self.tls_key):
            p.append("server.tls_cert and server.tls_key must be given together")
        if not self.host:
            p.append("server.host: must not be empty")
        if self.processes != "auto" and not (isinstance(self.processes, int) and 1 <= self.processes <= 256):
            p.append(f"server.processes: {self.processes!r} is not a process count (1..256) or \"auto\"")


@dataclass(frozen=True, slots=True)
class ShutdownSettings:
    drain_timeout: float = 30.0  # SIGTERM: finish in-flight requests for up to this long
    sigint_drain_timeout: float = 3.0  # SIGINT: the same, faster
    grace_period: float = 5.0  # SIGTERM: keep listening this long, /readyz 503 and new work refused, first

    def _validate(self, p: list[str]) -> None:
        if self.drain_timeout < 0 or self.sigint_drain_timeout < 0 or self.grace_period < 0:
            p.append("shutdown: timeouts must be >= 0")
