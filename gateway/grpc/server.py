"""The native gRPC listener: grpclib serving Inference, health and reflection.

``serve.py`` starts one per gateway process beside the HTTP listeners (same
event loop; ``reuse_port`` when a process runs per core) and closes it on
shutdown: :meth:`NativeServer.close` first reports NOT_SERVING on
``grpc.health.v1`` so balancers stop sending calls, then stops accepting and
waits for the calls in flight.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from grpclib.health.check import ServiceStatus
from grpclib.server import Server

from .backend import Backend
from .service import build_services

__all__ = ["NativeServer", "start_native"]

DEFAULT_PORT = 50051


@dataclass(frozen=True, slots=True)
class NativeServer:
    server: Server
    health: ServiceStatus
    port: int

    async def close(self) -> None:
        self.health.set(False)
        self.server.close()
        await self.server.wait_closed()


async def start_native(backend: Backend, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                       reuse_port: bool = False) -> NativeServer:
    """Listen on ``host:port`` (0: any free port, reported in ``.port``)."""
    services, health = build_services(backend)
    server = Server(services)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    await server.start(sock=sock)
    return NativeServer(server, health, sock.getsockname()[1])
