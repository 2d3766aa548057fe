"""The ``quicserve.v1.Inference`` service, plus gRPC health and server reflection.

Handlers take any :class:`CallStream` -- grpclib's server stream is one, and
:mod:`.call_core` supplies ours -- so native gRPC and gRPC-Web run the same code. Each RPC turns its request into a :class:`GenerateSpec`, runs one
:class:`Generation` per reply and ends with a gRPC status from the one error
model (:func:`~gateway.grpc.status.grpc_status`). Client cancellation and an
expired ``grpc-timeout`` cancel the handler task (:func:`.call_core.run_call`); the
``finally`` around every generation then cancels it on the backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.metadata import Deadline
from grpclib.reflection.service import ServerReflection

from .. import clock
from ..errors import APIError
from .backend import Backend, Finished, Generation
from .chat import ChatSession
from .convert import reason_of, spec_from, text_metadata, usage_of
from .quicserve.v1 import quicserve_pb2 as pb
from .quicserve.v1.quicserve_grpc import InferenceBase
from .status import Status, grpc_status, retry_trailers

if TYPE_CHECKING:
    from grpclib._typing import IServable

__all__ = ["CallStream", "InferenceService", "build_services"]

_Req = TypeVar("_Req", covariant=True)
_Resp = TypeVar("_Resp", contravariant=True)


class CallStream(Protocol[_Req, _Resp]):
    """What a handler uses of a call: grpclib's ``server.Stream`` has exactly this."""

    @property
    def deadline(self) -> Deadline | None: ...

    @property
    def metadata(self) -> Mapping[str, str | bytes] | None: ...

    async def recv_message(self) -> _Req | None: ...

    async def send_message(self, message: _Resp) -> None: ...

    async def send_trailing_metadata(self, *, status: Status = ..., status_message: str | None = ...,
                                     metadata: Sequence[tuple[str, str]] | None = ...) -> None: ...


def _deadline(stream: CallStream[Any, Any]) -> float | None:
    return None if stream.deadline is None else clock.now() + stream.deadline.time_remaining()


async def _fail(stream: CallStream[Any, Any], err: APIError) -> None:
    await stream.send_trailing_metadata(status=grpc_status(err), status_message=err.message,
                                        metadata=retry_trailers(err))


class InferenceService(InferenceBase):
    """``quicserve.v1.Inference`` over a :class:`Backend`."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    async def _start(self, stream: CallStream[pb.GenerateRequest, Any]) -> Generation | None:
        """Read the request and start its generation; a bad request is answered here (None)."""
        request = await stream.recv_message()
        if request is None:  # the client ended its side without the one message
            await stream.send_trailing_metadata(status=Status.INTERNAL, status_message="no request message")
            return None
        try:
            spec = spec_from(request, _deadline(stream), text_metadata(stream.metadata))
        except APIError as e:
            await _fail(stream, e)
            return None
        return Generation(self._backend, spec)

    async def Generate(self, stream: CallStream[pb.GenerateRequest, pb.GenerateResponse]) -> None:
        if (gen := await self._start(stream)) is None:
            return
        try:
            while True:
                text, outcome = await gen.next()
                if outcome is None:
                    await stream.send_message(pb.GenerateResponse(text=text))
                elif isinstance(outcome, Finished):
                    return await stream.send_message(pb.GenerateResponse(
                        text=text, finish_reason=reason_of(outcome), usage=usage_of(outcome)))
                else:
                    if text:  # what was generated before the error still reaches the client
                        await stream.send_message(pb.GenerateResponse(text=text))
                    return await _fail(stream, outcome)
        finally:
            gen.cancel()

    async def Complete(self, stream: CallStream[pb.GenerateRequest, pb.GenerateResponse]) -> None:
        if (gen := await self._start(stream)) is None:
            return
        pieces: list[str] = []
        try:
            while True:
                text, outcome = await gen.next()
                pieces.append(text)
                if isinstance(outcome, Finished):
                    return await stream.send_message(pb.GenerateResponse(
                        text="".join(pieces), finish_reason=reason_of(outcome), usage=usage_of(outcome)))
                if outcome is not None:
                    return await _fail(stream, outcome)
        finally:
            gen.cancel()

    async def Chat(self, stream: CallStream[pb.ChatRequest, pb.ChatResponse]) -> None:
        await ChatSession(self._backend, stream.recv_message, stream.send_message, _deadline(stream),
                          text_metadata(stream.metadata)).run()

    async def ListModels(self, stream: CallStream[pb.ListModelsRequest, pb.ListModelsResponse]) -> None:
        await stream.recv_message()
        try:
            self._backend.authorize(text_metadata(stream.metadata))  # a key, where keys are required
        except APIError as e:
            return await _fail(stream, e)
        await stream.send_message(pb.ListModelsResponse(models=[pb.Model(id=m) for m in self._backend.models()]))


def build_services(backend: Backend) -> tuple[list[IServable], ServiceStatus]:
    """The services: Inference, ``grpc.health.v1`` and reflection (grpclib's; their ``__mapping__()``
    is what :mod:`.native_server` serves).

    The returned status is the Inference service's health (and the server's
    overall health): set it to ``False`` while draining so balancers stop
    sending new calls.
    """
    inference = InferenceService(backend)
    status = ServiceStatus()
    status.set(True)
    return ServerReflection.extend([inference, Health({inference: [status]})]), status
