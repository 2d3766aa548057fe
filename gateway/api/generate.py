"""Starting a generation: admission -> routing -> :class:`~gateway.api.call.GenerationCall`.

The part of the pipeline every protocol shares once its request is parsed:
the OpenAI routes (``gateway.app``) and the gRPC service (``gateway.grpc``)
both come through :meth:`Generations.start`, so admission, routing, deadlines,
retries, metrics and the one end are the same whatever carried the request.
A refusal (parse, admission or routing error) is rendered by the caller's
``fail`` (its wire format's error writer), counted, and ends the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from ..errors import APIError, from_routing, internal_error
from ..http.types import Call, Request, ResponseSink
from ..observability.metrics import GatewayMetrics
from ..routing.errors import RoutingError
from ..routing.policy import RouteRequest
from ..routing.pool import ModelPool
from .call import CallContext, GenerationCall
from .openai import prompt_estimate
from .params import GenerationRequest
from .writers import Writer

__all__ = ["Generations", "AdmissionStage", "NoAdmission", "ANSWERED"]

log = logging.getLogger("quicserve.api")
_perf = time.perf_counter


class AdmissionStage(Protocol):
    """What runs after parsing and before routing: auth, limits, shedding (``gateway.admission``)."""

    def admit(self, req: Request, g: GenerationRequest, now: float) -> object:
        """A grant for this request, or raise :class:`APIError` (401/403/429/503) to refuse it."""
        ...

    def release(self, grant: object, completion_tokens: int, now: float) -> None:
        """The request ended (exactly once per grant)."""
        ...


class NoAdmission:
    """Every request admitted (the default until keys, limits or shedding are configured)."""

    def admit(self, req: Request, g: GenerationRequest, now: float) -> object:
        return None

    def release(self, grant: object, completion_tokens: int, now: float) -> None:
        return None


class _Answered:
    """The :class:`Call` of a request answered at once: nothing to cancel."""

    __slots__ = ()

    def cancel(self) -> bool:
        return False


ANSWERED = _Answered()


class Generations:
    """Admission, routing and the generation call, shared by every protocol."""

    def __init__(self, pool: ModelPool, metrics: GatewayMetrics, calls: CallContext,
                 admission: AdmissionStage) -> None:
        self.pool = pool
        self.metrics = metrics
        self.calls = calls
        self.admission = admission
        self._loop: asyncio.AbstractEventLoop | None = None

    def later(self, done: Callable[[], None]) -> None:
        """``done`` on the next loop iteration (never inside an entrance call)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        loop.call_soon(done)

    def start(self, req: Request, parse: Callable[[Request], GenerationRequest],
              writer_for: Callable[[GenerationRequest], Writer], fail: Callable[[APIError], None],
              sink: ResponseSink, done: Callable[[], None], route: str, t0: float,
              timeout: float | None = None) -> Call:
        """Parse, admit, route and start one generation; a refusal goes to ``fail`` and ends it."""
        metrics = self.metrics
        metrics.in_flight += 1
        admission = self.admission
        grant: object = None
        admitted = False
        try:
            g = parse(req)
            grant = admission.admit(req, g, t0)
            admitted = True
            routed = self.pool.open(RouteRequest(g.model, prompt_estimate(g), g.params.max_tokens), g.make_submit)
        except (APIError, RoutingError) as e:
            err = e if isinstance(e, APIError) else from_routing(e)
            return self._refuse(req, fail, done, route, err, t0, grant if admitted else _NO_GRANT)
        except Exception:
            log.exception("unhandled error in %s %s", req.method, req.path)
            return self._refuse(req, fail, done, route, internal_error(), t0, grant if admitted else _NO_GRANT)
        protocol = req.protocol

        def on_end(status: int, tokens: int) -> None:
            metrics.in_flight -= 1
            now = _perf()
            metrics.request_done(route, status, protocol, now - t0)
            admission.release(grant, tokens, now)

        call = GenerationCall(self.calls, routed, writer_for(g), sink, route, t0, g.logprobs, on_end, done,
                              timeout)
        call.start()
        return call

    def refuse(self, req: Request, fail: Callable[[APIError], None], done: Callable[[], None], route: str,
               err: APIError, t0: float) -> Call:
        """A generation request refused before it was counted (e.g. while draining)."""
        self.metrics.in_flight += 1
        return self._refuse(req, fail, done, route, err, t0, _NO_GRANT)

    def _refuse(self, req: Request, fail: Callable[[APIError], None], done: Callable[[], None], route: str,
                err: APIError, t0: float, grant: object) -> Call:
        if grant is not _NO_GRANT:
            self.admission.release(grant, 0, _perf())
        self.metrics.in_flight -= 1
        fail(err)
        self.metrics.request_done(route, err.status, req.protocol, _perf() - t0)
        self.later(done)
        return ANSWERED


_NO_GRANT = object()
