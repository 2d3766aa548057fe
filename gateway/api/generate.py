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
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from transport.api import Collected
from transport.messages import Finish

from .. import clock
from ..errors import APIError, from_routing, internal_error
from ..http.types import Call, Request, ResponseSink
from ..observability.logs import access_log
from ..observability.metrics import GatewayMetrics
from ..observability.tracing import RequestSpan, RequestTracer
from ..routing.errors import NoReplica, RoutingError
from ..routing.policy import RouteRequest
from ..routing.pool import ModelPool
from ..routing.rollout import Rollouts
from ..routing.routed import RoutedStream
from ..routing.rules import RuleTree, Shadow
from .call import WHOLE, CallContext, GenerationCall
from .fanout import FanOut
from .params import GenerationRequest
from .route_facts import Identify, RouteFacts
from .writers import Writer

__all__ = ["Generations", "AdmissionStage", "Fail", "ANSWERED"]

log = logging.getLogger("quicserve.api")
_perf = clock.now  # the request clock (gateway/clock.py): t0, admission's now, latencies


class AdmissionStage(Protocol):
    """What runs after parsing and before routing: auth, limits, shedding (``gateway.admission``)."""

    def admit(self, req: Request, g: GenerationRequest, now: float, deadline: float | None) -> object:
        """A grant for this request, or raise :class:`APIError` (401/403/429/503) to refuse it;
        ``deadline``: the seconds the request may take, when it has its own (gRPC's timeout)."""
        ...

    def headers(self, grant: object) -> tuple[tuple[bytes, bytes], ...]:
        """Headers an admitted request's response carries (``x-ratelimit-*``)."""
        ...

    def release(self, grant: object, completion_tokens: int, now: float) -> None:
        """The request ended (exactly once per grant)."""
        ...


Fail = Callable[[ResponseSink, APIError], None]
"""How a route renders a refusal on its sink (its wire format's error writer)."""


class _Answered:
    """The :class:`Call` of a request answered at once: nothing to cancel."""

    __slots__ = ()

    def cancel(self) -> bool:
        return False


ANSWERED = _Answered()


class Generations:
    """Admission, routing and the generation call, shared by every protocol."""

    def __init__(self, pool: ModelPool, metrics: GatewayMetrics, calls: CallContext,
                 admission: AdmissionStage | None, tracer: RequestTracer | None = None,
                 access_log: bool = False, rules: RuleTree | None = None, identify: Identify | None = None,
                 rollouts: Rollouts | None = None) -> None:
        self.pool = pool
        self.rollouts = rollouts if rollouts else None  # gray releases, by stable model
        self.rules = rules  # [[routes]]: which model a request goes to (None: the one it names)
        self.identify = identify  # the API key's id and tier, for rules that read them
        self.metrics = metrics
        self.calls = calls
        self.admission = admission  # None: every request admitted, at no cost
        self.tracer = tracer if tracer is not None and tracer.enabled else None  # None: no span, no cost
        self.access_log = access_log
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_call_end = self._call_ended  # every call's end hook: bound once, not a closure per request
        pool.describe = route_request  # what a routing policy sees, built only when one is asked

    def later(self, done: Callable[[], None]) -> None:
        """``done`` on the next loop iteration (never inside an entrance call)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        loop.call_soon(done)

    def start(self, req: Request, parse: Callable[[Request], GenerationRequest],
              writer_for: Callable[[GenerationRequest], Writer], fail: Fail, sink: ResponseSink,
              done: Callable[[], None], route: str, t0: float, timeout: float | None = None) -> Call:
        """Parse, admit, route and start one generation; a refusal goes to ``fail(sink, err)`` and
        ends it."""
        metrics = self.metrics
        metrics.in_flight += 1
        admission = self.admission
        grant: object = _NO_GRANT
        span: RequestSpan | None = None
        g: GenerationRequest | None = None
        try:
            g = parse(req)
            if self.pool.aliases:  # an alias names its model from here on (limits, routing, the answer)
                g.model = self.pool.canonical(g.model)
            fallbacks: tuple[str, ...] = ()
            shadow: Shadow | None = None
            if self.rules is not None:
                decision = self.rules.decide(RouteFacts(req, g, self.identify))
                if decision is not None:
                    g.route = decision.leaf
                    g.model, *more = decision.models
                    fallbacks, shadow = tuple(more), decision.shadow
            if self.rollouts is not None and (ro := self.rollouts.by_stable.get(g.model)) is not None:
                g.model, g.rollout = ro.pick(), ro
            if admission is not None:
                grant = admission.admit(req, g, t0, timeout)
            if self.tracer is not None:
                span = self.tracer.start(route, _text(req.header(b"traceparent")), protocol=req.protocol)
                if span is not None:
                    g.trace = {"traceparent": span.traceparent}  # the worker's spans join this trace
            fan = None
            if g.fan is not None:  # n > 1, best_of, a batch of prompts: several sequences on one replica
                fan = FanOut(self.pool, g, writer_for)
                routed = fan.routed
            else:
                try:
                    routed = self.pool.open(g.model, g.make_submit, g)
                except NoReplica:
                    routed = self._fallback(g, fallbacks)
        except (APIError, RoutingError) as e:
            err = e if isinstance(e, APIError) else from_routing(e)
            if g is not None and g.rollout is not None:  # e.g. the candidate has no ready replica
                g.rollout.observe(g.model, err.status, None, None)
            if span is not None:
                span.end(err.status, model=req.path, error=err.message)
            return self._refuse(req, fail, sink, done, route, err, t0, grant, self._label(g))
        except Exception:
            log.exception("unhandled error in %s %s", req.method, req.path)
            return self._refuse(req, fail, sink, done, route, internal_error(), t0, grant, self._label(g))
        headers = admission.headers(grant) if admission is not None else None
        if span is not None:
            headers = (*(headers or ()), (b"traceparent", span.traceparent.encode()))
        if g.route:
            headers = (*(headers or ()), (b"x-quicserve-route", g.route.encode()))
            self.metrics.routed(g.route, g.model)
        call: GenerationCall | FanOut
        if fan is None:
            call = GenerationCall(self.calls, routed, writer_for(g), sink, route, t0, g.logprobs, self._on_call_end,
                                  done, timeout, headers, (req, g, grant, span))
        else:
            call = fan.call(self.calls, sink, route, t0, self._on_call_end, done, timeout, headers, (req, g, grant, span))
        call.start()
        if shadow is not None and fan is None:  # (a shadow copies one sequence: not a fanned-out request)
            self._shadow(g, shadow)
        return call

    def _shadow(self, g: GenerationRequest, shadow: Shadow) -> None:
        """A copy of ``g`` to the shadow arm's model, if it is this request's turn: its answer is
        read whole and dropped; nothing of it reaches the client or its limits."""
        taken = shadow.take()
        if not taken:
            if taken is None:
                self.metrics.shadowed(g.route, shadow.to, "skipped")
            return
        copy = replace(g, model=shadow.to, stream=False, logprobs=False, top_logprobs=0, rollout=None, trace=None)
        try:
            routed = self.pool.open(shadow.to, copy.make_submit, copy)
        except RoutingError:
            shadow.done()
            self.metrics.shadowed(g.route, shadow.to, "failed")
            return
        stream = routed.stream
        assert stream is not None

        def ended(fut: asyncio.Future[Collected]) -> None:
            routed.close()
            shadow.done()
            ok = not fut.cancelled() and fut.exception() is None and type(fut.result().final) is Finish
            self.metrics.shadowed(g.route, shadow.to, "ok" if ok else "failed")

        stream.collect().add_done_callback(ended)

    def _fallback(self, g: GenerationRequest, fallbacks: tuple[str, ...]) -> RoutedStream:
        """``g.model`` has no ready replica: each fallback in turn (the rule's chain, else the
        model's own ``fallback``) that has one; NoReplica if none does."""
        if not fallbacks and g.model in self.pool.fallbacks:
            fallbacks = (self.pool.fallbacks[g.model],)
        first = g.model
        for model in fallbacks:
            g.model = model
            try:
                return self.pool.open(model, g.make_submit, g)
            except NoReplica:
                continue
        raise NoReplica(first)

    def _call_ended(self, call: GenerationCall | FanOut, status: int, tokens: int) -> None:
        """A call's end hook: metrics, the admission release, span and access log (its ticket is
        what :meth:`start` gave it: request, parsed request, grant, span)."""
        metrics = self.metrics
        metrics.in_flight -= 1
        now = _perf()
        req, g, grant, span = call.ticket
        t_first = call.t_first
        ttft = t_first - call.t0 if t_first else None
        if status == 200:  # finished: its tokens, and their pace if they came one step at a time
            tpot = (now - t_first) / (tokens - 1) if call.mode != WHOLE and tokens > 1 and t_first else None
            metrics.request_done(call.route, 200, req.protocol, now - call.t0, g.model, ttft, tpot, tokens)
        else:
            metrics.request_done(call.route, status, req.protocol, now - call.t0, g.model)
        self.pool.outcome(call.routed.conn, g.model, status, ttft, now)
        admission = self.admission
        if grant is not _NO_GRANT and admission is not None:
            admission.release(grant, tokens, now)
        if g.rollout is not None:
            g.rollout.observe(g.model, status, ttft, (now - t_first) / (tokens - 1) if t_first and tokens > 1 else None)
        if span is not None or self.access_log:
            _observed(req, g.model, span, self.access_log, status, tokens, call.t0, call.t_first, now, route=g.route)

    def refuse(self, req: Request, fail: Fail, sink: ResponseSink, done: Callable[[], None], route: str,
               err: APIError, t0: float) -> Call:
        """A generation request refused before it was counted (e.g. while draining)."""
        self.metrics.in_flight += 1
        return self._refuse(req, fail, sink, done, route, err, t0, _NO_GRANT)

    def _label(self, g: GenerationRequest | None) -> str:
        """A refused request's ``model`` label: a name the pool knows, else "" (bounded cardinality)."""
        return g.model if g is not None and self.pool.knows(g.model) else ""

    def _refuse(self, req: Request, fail: Fail, sink: ResponseSink, done: Callable[[], None], route: str,
                err: APIError, t0: float, grant: object, model: str = "") -> Call:
        if grant is not _NO_GRANT and self.admission is not None:
            self.admission.release(grant, 0, _perf())
        self.metrics.in_flight -= 1
        fail(sink, err)
        now = _perf()
        self.metrics.request_done(route, err.status, req.protocol, now - t0, model)
        if self.access_log:
            _observed(req, "", None, True, err.status, 0, t0, 0.0, now, err.code or "")
        self.later(done)
        return ANSWERED


_NO_GRANT = object()


def route_request(model: str, g: object) -> RouteRequest:
    """A generation request as a routing policy sees it (the pool's ``describe``)."""
    assert isinstance(g, GenerationRequest)
    return RouteRequest(model, g.prompt_estimate(), g.params.max_tokens)


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value else None


def _observed(req: Request, model: str, span: RequestSpan | None, access: bool, status: int, tokens: int,
              t0: float, t_first: float, now: float, error: str = "", route: str = "") -> None:
    """The end of a request for its span and the access log (only when either is on)."""
    ttft = t_first - t0 if t_first else None
    if span is not None:
        end_ns = clock.wall_ns()
        if t_first:
            span.first_token(end_ns - int((now - t_first) * 1e9))
        span.end(status, model=model, completion_tokens=tokens, now_ns=end_ns, route=route)
    if access:
        access_log(method=req.method, path=req.path, protocol=req.protocol, status=status, duration_s=now - t0,
                   trace_id=span.trace_id if span is not None else "", model=model,
                   peer=req.client[0] if req.client is not None else "", ttft_s=ttft,
                   completion_tokens=tokens if tokens else None, error=error, route=route)
