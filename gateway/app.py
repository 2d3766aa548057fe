"""The gateway's application handler: route table, errors at the edge, metrics.

``App`` is a :data:`gateway.http.types.Handler`: protocol adapters call it with
a fully read :class:`Request` and a :class:`ResponseSink`. Routing is one dict
lookup on the path and one on the method; 404 and 405 (with ``Allow``) come
from the table. Every :class:`APIError` raised before a response started is
rendered here, once, as OpenAI error JSON.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import orjson

from .api.openai import CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE, OpenAIHandlers
from .api.render import JSON_HEADERS
from .errors import APIError, error_headers, render_json
from .http.common import ProtocolEvent, run_request, spawn
from .http.types import Call, Request, ResponseSink
from .observability.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from .routing.pool import ModelPool
from .settings import ApiSettings

__all__ = ["App", "Route"]

log = logging.getLogger("quicserve.app")

Route = Callable[[Request, ResponseSink, float], Awaitable[int]]

_perf = time.perf_counter
_OK = orjson.dumps({"status": "ok"})
_METRICS_HEADERS = [(b"content-type", CONTENT_TYPE_LATEST.encode())]


class App:
    """Route table + error rendering + request metrics around :class:`OpenAIHandlers`."""

    def __init__(self, pool: ModelPool, metrics: GatewayMetrics | None = None,
                 api: ApiSettings | None = None) -> None:
        self.pool = pool
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.openai = OpenAIHandlers(pool, self.metrics, api or ApiSettings())
        self.metrics.watch_workers(pool.connections)
        self.draining = False
        self.routes: dict[str, dict[str, Route]] = {
            CHAT_ROUTE: {"POST": self.openai.chat},
            COMPLETIONS_ROUTE: {"POST": self.openai.completions},
            MODELS_ROUTE: {"GET": self.openai.models},
            "/healthz": {"GET": self.healthz},
            "/readyz": {"GET": self.readyz},
            "/metrics": {"GET": self.metrics_page},
        }
        for methods in self.routes.values():
            if "GET" in methods:  # RFC 9110 9.1; the adapters send a HEAD response without its body
                methods.setdefault("HEAD", methods["GET"])
        self._allow = {path: ", ".join(sorted(m)).encode() for path, m in self.routes.items()}
        if pool.on_retry is None:
            pool.on_retry = self.metrics.retries.inc

    async def __call__(self, req: Request, sink: ResponseSink) -> None:
        t0 = _perf()
        path = req.path
        methods = self.routes.get(path)
        route = path
        handler: Route
        if methods is not None:
            handler = methods.get(req.method) or self._not_allowed
        elif path.startswith("/v1/models/") and len(path) > 11:
            handler = self.openai.model if req.method in ("GET", "HEAD") else self._not_allowed
            route = "/v1/models/{id}"
        else:
            handler, route = self._not_found, "other"
        await self._serve(req, sink, t0, route, handler)

    async def _not_found(self, req: Request, sink: ResponseSink, t0: float) -> int:
        raise APIError(404, f"Unknown request URL: {req.method} {req.path}. Please check the URL for typos.",
                       "invalid_request_error", None, "unknown_url")

    async def _not_allowed(self, req: Request, sink: ResponseSink, t0: float) -> int:
        allow = self._allow.get(req.path, b"GET, HEAD")
        await sink.respond(405, [*JSON_HEADERS, (b"allow", allow)], render_json(APIError(
            405, f"Method {req.method} is not allowed for {req.path}; allowed: {allow.decode()}.",
            "invalid_request_error", None, "method_not_allowed")))
        return 405

    async def _serve(self, req: Request, sink: ResponseSink, t0: float, route: str, handler: Route) -> None:
        """Run one request's handler: errors rendered here, once; metrics recorded."""
        status = 499
        metrics = self.metrics
        metrics.in_flight += 1
        try:
            status = await handler(req, sink, t0)
        except APIError as e:
            status = e.status
            await sink.respond(e.status, error_headers(e), render_json(e))
        except (asyncio.CancelledError, ConnectionError):
            status = 499  # the client went away (cancelled by the adapter, or a write failed)
            raise
        except Exception:
            log.exception("unhandled error in %s %s", req.method, req.path)
            status = 500
            await sink.respond(500, JSON_HEADERS, render_json(APIError(
                500, "Internal server error.", "server_error", None, "internal_error")))
        finally:
            metrics.in_flight -= 1
            metrics.request_done(route, status, req.protocol, _perf() - t0)

    def fast(self, req: Request, sink: ResponseSink, done: Callable[[], None]) -> Call | None:
        """How the h1 adapter starts a request (:data:`gateway.http.types.FastHandler`).

        A generation request is parsed here, once: a plain non-streaming one runs
        without a task (:mod:`gateway.api.unary`); a stream or a logprobs request runs
        in a task of its own with the parsed request. None for everything else (and
        for a body that does not parse): the adapter then runs :meth:`__call__`.
        """
        if req.method != "POST":
            return None
        t0 = _perf()
        route = req.path
        h = self.openai
        g = h.parse(req)
        if g is None:
            return None
        respond = getattr(sink, "respond_nowait", None)
        if respond is not None and not g.stream and not g.logprobs:
            metrics = self.metrics
            protocol = req.protocol

            def on_end(status: int) -> None:  # never before unary_call returns (its ends are callbacks)
                metrics.in_flight -= 1
                metrics.request_done(route, status, protocol, _perf() - t0)

            call = h.unary_call(g, route, respond, t0, on_end, done)
            if call is not None:
                metrics.in_flight += 1
                return call
        task = spawn(asyncio.get_running_loop(), run_request(
            lambda r, s: self._serve(r, s, t0, route, lambda r, s, t: h.generate(g, s, t, route)), req, sink))
        task.add_done_callback(lambda _: done())
        return task

    # -- small routes -------------------------------------------------------------------
    async def healthz(self, req: Request, sink: ResponseSink, t0: float) -> int:
        await sink.respond(200, JSON_HEADERS, _OK)
        return 200

    async def readyz(self, req: Request, sink: ResponseSink, t0: float) -> int:
        ready = self.pool.ready_workers()
        if ready and not self.draining:
            await sink.respond(200, JSON_HEADERS, orjson.dumps(
                {"status": "ready", "workers": ready, "models": self.pool.models()}))
            return 200
        why = "draining" if self.draining else "no worker is ready"
        await sink.respond(503, JSON_HEADERS, orjson.dumps({"status": "not ready", "reason": why, "workers": ready}))
        return 503

    async def metrics_page(self, req: Request, sink: ResponseSink, t0: float) -> int:
        self.metrics.workers_ready.set(self.pool.ready_workers())
        await sink.respond(200, _METRICS_HEADERS, self.metrics.render())
        return 200

    def on_http_event(self, event: ProtocolEvent) -> None:
        """``on_event`` hook for protocol adapters: a request rejected before routing (400/408/413/431)."""
        self.metrics.protocol_error(event.status, event.protocol)

