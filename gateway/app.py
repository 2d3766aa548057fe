"""The request pipeline: the one entrance every protocol adapter calls.

How it works (``docs/ARCHITECTURE.md`` has the picture)::

    adapter -> Request -> App.handle: route table -> admission -> parse + validate
      -> routing policy (pool, replica) -> GenerationCall (deadline, cancel, retry,
      metrics; ends once) -> writer (JSON | SSE | ...) -> the adapter's sink

:meth:`App.handle` is an :data:`~gateway.http.types.Entrance`: it takes every
request, answers through the sink and calls ``done()`` once. Small routes
(health, readiness, metrics, model lists) answer at once; generation routes
hand back a :class:`~gateway.api.call.GenerationCall`, which runs on callbacks.
No request gets a task of its own. Errors raised before a response starts are
one :class:`~gateway.errors.APIError`, rendered by the writer of the route's
wire format; routing errors are converted at this edge.

Seams: an admission stage (:class:`AdmissionStage`) runs before anything is
routed; the pool's routing policy picks the replica; a writer per wire format.

When the admission stage requires API keys, every other route needs one too
(``/v1/models`` lists what exists; ``/admin`` tells how traffic moves), as vLLM's
``--api-key`` guards every ``/v1`` route; only :data:`OPEN_ROUTES` (probes and
the scrape) answer without. A missing or bad key is the admission's own 401.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable

import orjson

from . import clock
from .admission.keys import KeyStore
from .admission.stage import AdmissionStageAdapter
from .api.call import CallContext
from .api.config import ApiSettings
from .api.deadlines import DeadlineSweeper
from .api.embeddings import EMBEDDINGS_ROUTE, Embeddings
from .api.generate import ANSWERED, AdmissionStage, Generations
from .api.openai import MODELS_ROUTE, OpenAIApi, Parser, Validate
from .api.prompt_tasks import PromptTasks
from .api.render import JSON_HEADERS
from .api.route_facts import Identify
from .api.tokenize import DETOKENIZE_ROUTE, TOKENIZE_ROUTE, Tokenize
from .api.writers import writer_for
from .errors import APIError, Headers, internal_error, render_http
from .http.common import ProtocolEvent
from .http.types import Call, Entrance, Request, ResponseSink, StreamsBody
from .observability.logs import access_log as write_access_log
from .observability.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from .observability.tracing import RequestTracer
from .routing.pool import ModelPool
from .routing.rollout import Rollouts
from .routing.rules import RuleTree

__all__ = ["App", "AdmissionStage", "OPEN_ROUTES"]

log = logging.getLogger("quicserve.app")

_perf = clock.now  # the request clock (gateway/clock.py): t0, admission's now, latencies
_OK = orjson.dumps({"status": "ok"})
_METRICS_HEADERS = [(b"content-type", CONTENT_TYPE_LATEST.encode())]

Answer = tuple[int, Headers, bytes]
SmallRoute = Callable[[Request], Answer]

OPEN_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
"""The routes that answer without an API key when keys are required (liveness, readiness, scrape)."""


def _required_keys(admission: AdmissionStage | None) -> KeyStore | None:
    """The keys every route but :data:`OPEN_ROUTES` checks: the admission stage's, when it requires them."""
    if isinstance(admission, AdmissionStageAdapter) and admission.admission.auth_required:
        return admission.admission.keys
    return None


_SHUTTING_DOWN = APIError(503, "The server is shutting down; retry on another instance.", "server_error", None,
                          "shutting_down", retry_after=1.0, headers=((b"connection", b"close"),))
_CUT = APIError(503, "The server shut down before the response finished.", "server_error", None, "shutting_down")


def _http_failure(sink: ResponseSink, err: APIError) -> None:
    sink.respond(*render_http(err))


class App:
    """Route table, the generation pipeline, and request metrics."""

    def __init__(self, pool: ModelPool, metrics: GatewayMetrics | None = None, api: ApiSettings | None = None,
                 admission: AdmissionStage | None = None, validate: Validate | None = None,
                 tracer: RequestTracer | None = None, access_log: bool = False, rules: RuleTree | None = None,
                 identify: Identify | None = None, rollouts: Rollouts | None = None) -> None:
        self.pool = pool
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.api_settings = api or ApiSettings()
        self.openai = OpenAIApi(self.api_settings, validate)
        self.deadlines = DeadlineSweeper()
        self.calls = CallContext(self.deadlines, self.api_settings.request_timeout, self.api_settings.write_timeout)
        self.generations = Generations(pool, self.metrics, self.calls, admission, tracer, access_log, rules, identify,
                                       rollouts)
        self.rollouts = rollouts
        self.keys = _required_keys(admission)  # None: no key needed anywhere but where admission asks
        self.config_problem: str | None = None  # why the last config reload was refused (/readyz says)
        self.metrics.watch_workers(pool.connections)
        self.draining = False
        self.worker_failure: Callable[[], str | None] = lambda: None  # serve.py: the supervisor's failure
        self.small: dict[str, dict[str, SmallRoute]] = {
            MODELS_ROUTE: {"GET": self._models},
            "/healthz": {"GET": self._healthz},
            "/readyz": {"GET": self._readyz},
            "/metrics": {"GET": self._metrics_page},
            "/admin/rollouts": {"GET": self._rollouts_page},
        }
        self.generation: dict[str, Parser] = dict(OpenAIApi.GENERATION)
        self._parse = {path: functools.partial(self.openai.parse, parse) for path, parse in self.generation.items()}
        self.mounted: dict[str, Entrance] = {}  # other protocols' routes on the HTTP listeners (gRPC-Web)
        self._streamed: dict[str, StreamsBody] = {}  # mounted routes that read their body as it arrives
        tasks = PromptTasks(pool, self.api_settings, lambda: self.keys, lambda: self.draining, self.metrics)
        tok = Tokenize(tasks)
        for path, route in ((EMBEDDINGS_ROUTE, Embeddings(tasks)), (TOKENIZE_ROUTE, tok.tokenize),
                            (DETOKENIZE_ROUTE, tok.detokenize)):
            self.mount([path], tasks.entrance(route))
        for methods in self.small.values():  # RFC 9110 9.1; the adapters send a HEAD response without its body
            methods["HEAD"] = methods["GET"]
        allowed = {path: sorted(m) for path, m in self.small.items()}
        allowed.update({path: ["POST"] for path in self.generation})
        self._allow = {path: ", ".join(m) for path, m in allowed.items()}
        pool.active = self._in_flight  # the retry budget is a share of the requests in flight
        if pool.on_retry is None:
            pool.on_retry = self.metrics.retries.inc
        if pool.on_move is None:
            pool.on_move = self.metrics.rebalanced.inc

    # -- the entrance ---------------------------------------------------------------------
    def handle(self, req: Request, sink: ResponseSink, done: Callable[[], None]) -> Call:
        """Take one request (see :data:`~gateway.http.types.Entrance`)."""
        t0 = _perf()
        path = req.path
        parse = self._parse.get(path)
        if parse is not None and req.method == "POST":
            if self.draining:
                return self.generations.refuse(req, _http_failure, sink, done, path, _SHUTTING_DOWN, t0)
            return self.generations.start(req, parse, writer_for, _http_failure, sink, done, path, t0)
        mounted = self.mounted.get(path)
        if mounted is not None:
            return mounted(req, sink, done)
        route = path
        try:
            keys = self.keys
            if keys is not None and path not in OPEN_ROUTES:
                keys.maybe_reload(t0)
                keys.authenticate(req.header(b"authorization"))  # 401 like a generation route's
            methods = self.small.get(path)
            if methods is not None:
                small = methods.get(req.method)
                answer = small(req) if small is not None else self._not_allowed(req)
            elif parse is not None:
                answer = self._not_allowed(req)
            elif path.startswith("/v1/models/") and len(path) > 11:
                route = "/v1/models/{id}"
                if req.method not in ("GET", "HEAD"):
                    raise self._method_error(req, "GET, HEAD")
                answer = 200, JSON_HEADERS, self.openai.model_body(path[11:], self.pool.models(), self.pool.aliases)
            else:
                route = "other"
                raise APIError(404, f"Unknown request URL: {req.method} {path}. Please check the URL for "
                               "typos.", "invalid_request_error", None, "unknown_url")
        except APIError as e:
            answer = render_http(e)
        except Exception:
            log.exception("unhandled error in %s %s", req.method, path)
            answer = render_http(internal_error())
        sink.respond(*answer)
        elapsed = _perf() - t0
        self.metrics.request_done(route, answer[0], req.protocol, elapsed)
        if self.generations.access_log:
            write_access_log(method=req.method, path=path, protocol=req.protocol, status=answer[0], duration_s=elapsed,
                             peer=req.client[0] if req.client is not None else "")
        self.generations.later(done)
        return ANSWERED

    def _method_error(self, req: Request, allow: str) -> APIError:
        return APIError(405, f"Method {req.method} is not allowed for {req.path}; allowed: {allow}.",
                        "invalid_request_error", None, "method_not_allowed", headers=((b"allow", allow.encode()),))

    def _not_allowed(self, req: Request) -> Answer:
        raise self._method_error(req, self._allow.get(req.path, "GET, HEAD"))

    def mount(self, paths: Iterable[str], entrance: Entrance, streams: StreamsBody | None = None) -> None:
        """Serve ``paths`` through another protocol's entrance (gRPC-Web methods); ``streams``: which of
        their requests read the body as it arrives (see :meth:`streams_body`)."""
        for path in paths:
            self.mounted[path] = entrance
            if streams is not None:
                self._streamed[path] = streams

    def streams_body(self, req: Request) -> bool:
        """The listeners' :data:`~gateway.http.types.StreamsBody`: only mounted routes that asked for it."""
        streams = self._streamed.get(req.path)
        return streams is not None and streams(req)

    def end_all(self) -> int:
        """Drain deadline: every open generation call ends now with an explicit 503 (an error
        response, or its stream's terminal event). Returns how many were cut."""
        calls = self.deadlines.tracked()
        for call in calls:
            call.shut_down(_CUT)
        if calls:
            self.metrics.drain_cut.inc(len(calls))
        return len(calls)

    # -- small routes ------------------------------------------------------------------------
    def _models(self, req: Request) -> Answer:
        return 200, JSON_HEADERS, self.openai.models_body(self.pool.models(), self.pool.aliases)

    def _in_flight(self) -> int:
        return self.metrics.in_flight

    def _rollouts_page(self, req: Request) -> Answer:
        """Every gray release: its step, share, status and the current step's figures per arm (read-only)."""
        return 200, JSON_HEADERS, orjson.dumps({"rollouts": self.rollouts.states() if self.rollouts else {}})

    def _healthz(self, req: Request) -> Answer:
        return 200, JSON_HEADERS, _OK

    def _readyz(self, req: Request) -> Answer:
        ready = self.pool.ready_workers()
        if (ready or self.pool.models()) and not self.draining:  # (a pool scaled to zero still serves)
            body: dict[str, object] = {"status": "ready", "workers": ready, "models": self.pool.models()}
            if self.config_problem:
                body["config"] = self.config_problem
            degraded = self.pool.degraded()
            if degraded:
                body["degraded"] = degraded  # still ready: other models serve, fallbacks take traffic
            return 200, JSON_HEADERS, orjson.dumps(body)
        why = "draining" if self.draining else (self.worker_failure() or "no worker is ready")
        return 503, JSON_HEADERS, orjson.dumps({"status": "not ready", "reason": why, "workers": ready})

    def _metrics_page(self, req: Request) -> Answer:
        self.metrics.workers_ready.set(self.pool.ready_workers())
        return 200, _METRICS_HEADERS, self.metrics.render()

    def on_http_event(self, event: ProtocolEvent) -> None:
        """``on_event`` hook for protocol adapters: a request rejected before routing (400/408/413/431)."""
        self.metrics.protocol_error(event.status, event.protocol)
