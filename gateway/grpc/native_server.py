"""The native gRPC listener: Inference, health and reflection on our own HTTP/2 adapter.

The gRPC port is an HTTP listener (h2c with prior knowledge, like every gRPC
client speaks it) whose entrance is :class:`~gateway.grpc.native_route.NativeRoute`:
the grpclib service handlers (``__mapping__()`` of Inference, ``grpc.health.v1``
and server reflection) run through the same call core as gRPC-Web, so native
gRPC negotiates ``grpc-encoding`` (zstd, gzip, identity) like gRPC-Web does.
Every call's body is read as it arrives (bidi ``Chat``), acknowledged to the
client as the handler reads it; messages are bounded by ``max_message``, and a
call's whole body (a Chat's turns together) by the listener's body limit, at
least one message: HTTP/1.1 shares that limit and reads a body whole before the
route can refuse it (505), so the limit cannot be lifted for HTTP/2 alone.

``serve.py`` starts one per gateway process beside the HTTP listeners (same
event loop; ``reuse_port`` when a process runs per core) and closes it on
shutdown: :meth:`NativeServer.close` first reports NOT_SERVING on
``grpc.health.v1`` so balancers stop sending calls, then stops accepting
(GOAWAY) and waits for the calls in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from grpclib.const import Handler
from grpclib.health.check import ServiceStatus

from ..http.common import HttpLimits, task_entrance
from ..http.listeners import ListenerSpec, StreamListener, start_listener
from ..http.types import Entrance
from .backend import Backend
from .compression import Codecs
from .framing import HEADER_SIZE
from .native_generate import NativeEntrance
from .native_route import NativeRoute
from .pipeline_backend import PipelineBackend
from .service import build_services

__all__ = ["NativeServer", "start_native"]

DEFAULT_PORT = 50051


@dataclass(frozen=True, slots=True)
class NativeServer:
    listener: StreamListener
    health: ServiceStatus
    port: int

    def stop_accepting(self) -> None:
        """NOT_SERVING on the health service, then GOAWAY: open calls go on."""
        self.health.set(False)
        self.listener.stop_accepting()

    @property
    def in_flight(self) -> int:
        return self.listener.in_flight

    async def close(self, timeout: float | None = None) -> None:
        """NOT_SERVING, stop accepting, wait for the calls in flight (up to ``timeout``), close."""
        self.stop_accepting()
        await self.listener.wait_idle(timeout)
        await self.listener.close()


_UNBOUNDED = 1 << 62


async def start_native(backend: Backend, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                       reuse_port: bool = False, codecs: Codecs | None = None, max_message: int = 4 << 20,
                       limits: HttpLimits | None = None, write_timeout: float | None = None) -> NativeServer:
    """Listen on ``host:port`` (0: any free port, reported in ``.port``); ``write_timeout``: how long
    a call's client may read nothing before it is cut off (None: no bound)."""
    services, health = build_services(backend)
    handlers: dict[str, Handler] = {}
    for service in services:
        handlers.update(service.__mapping__())
    limits = limits or HttpLimits()
    codecs = codecs or Codecs()
    route = NativeRoute(handlers, codecs, max_message, limits.body_timeout, write_timeout)
    entrance: Entrance = task_entrance(route)
    if isinstance(backend, PipelineBackend):  # native Generate on the pipeline directly (no task per token)
        entrance = NativeEntrance(backend, entrance, codecs, max_message, limits.body_timeout)
    # HTTP/1.1 reads a body whole before the route can answer 505: bound it by one message. Over
    # HTTP/2 a call's body is read as it arrives, each message bounded by ``max_message`` and what is
    # unread by flow control, so a long Chat is not capped in all.
    limits = replace(limits, max_body_bytes=max(limits.max_body_bytes, max_message + HEADER_SIZE),
                     max_streamed_body_bytes=_UNBOUNDED)
    listener = await start_listener(entrance, ListenerSpec("tcp", host, port, reuse_port=reuse_port),
                                    limits=limits, streams_body=route.streams_body)
    return NativeServer(listener, health, listener.port)
