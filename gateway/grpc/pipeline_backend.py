"""The gRPC service's :class:`~gateway.grpc.backend.Backend`, bound to the one pipeline.

A :class:`GenerateSpec` becomes the same :class:`~gateway.api.params.GenerationRequest`
an OpenAI body would (validated by the same parser, so the two protocols accept
and refuse the same things), then goes through
:meth:`~gateway.api.generate.Generations.start`: admission, routing, the
generation call with its deadline (``grpc-timeout`` capped by the request
timeout), retries, metrics and its one end. :class:`DeltaWriter` is the gRPC
writer: instead of bytes for an HTTP sink it hands each engine step's text to
the service, which frames protobuf messages itself (through the call core,
:mod:`.call_core`, native and gRPC-Web alike), and ends with :class:`Finished` or the
:class:`APIError` the service maps to a gRPC status. Native ``Generate`` passes the service by:
:meth:`PipelineBackend.start` with a :class:`~gateway.grpc.native_frame_writer.GrpcFrameWriter` on its
HTTP/2 sink (:mod:`.native_generate`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import orjson

from transport.messages import Finish, TokenEntry

from .. import clock
from ..admission.keys import KeyStore
from ..api.generate import Fail, Generations
from ..api.openai import OpenAIApi
from ..api.params import GenerationRequest, parse_chat, parse_completion
from ..api.writers import Writer
from ..errors import APIError, Headers
from ..http.types import Call, Request, ResponseSink
from ..routing.pool import ModelPool
from .backend import Finished, GenerateSpec, OnDelta, OnEnd

__all__ = ["PipelineBackend", "DeltaWriter", "GRPC_ROUTE"]

GRPC_ROUTE = "grpc:quicserve.v1.Inference"  # the metrics route of every RPC
_perf = clock.now  # the request clock (gateway/clock.py)


class DeltaWriter:
    """The gRPC writer: text deltas and the outcome to the service's callbacks (no bytes)."""

    __slots__ = ("_on_delta", "_on_end")
    streaming = True
    headers: Headers = []
    trailers: Headers | None = None

    def __init__(self, on_delta: OnDelta, on_end: OnEnd) -> None:
        self._on_delta = on_delta
        self._on_end = on_end

    def opening(self) -> bytes:
        return b""

    def text(self, delta: bytes) -> bytes:
        self._on_delta(bytes(delta).decode("utf-8", "replace"))
        return b""

    def entries(self, events: list[TokenEntry]) -> bytes:
        self._on_delta(b"".join(bytes(ev.text) for ev in events).decode("utf-8", "replace"))
        return b""

    def finish(self, fin: Finish) -> bytes:
        self._on_end(Finished(fin.reason, fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens))
        return b""

    def error(self, err: APIError) -> tuple[int, Headers, bytes]:
        self._on_end(err)
        return err.status, [], b""

    def stream_error(self, err: APIError) -> bytes:
        self._on_end(err)
        return b""


class _CallbackSink:
    """The sink under a :class:`DeltaWriter`: the service does its own framing and flow control."""

    __slots__ = ()

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        pass

    def start(self, status: int, headers: Headers) -> None:
        pass

    def send_nowait(self, data: bytes) -> bool:
        return True

    async def send(self, data: bytes) -> None:
        pass

    def end(self, trailers: Headers | None = None) -> None:
        pass

    def abort(self) -> None:
        pass


_SINK = _CallbackSink()


class _Handle:
    __slots__ = ("call",)

    def __init__(self, call: Call) -> None:
        self.call = call

    def cancel(self) -> None:
        self.call.cancel()


def _noop() -> None:
    pass


class PipelineBackend:
    """``Backend`` over :class:`Generations` (the pipeline every protocol shares)."""

    def __init__(self, pool: ModelPool, generations: Generations, api: OpenAIApi, protocol: str = "grpc",
                 keys: KeyStore | None = None) -> None:
        self._pool = pool
        self._gen = generations
        self._api = api
        self._protocol = protocol
        self._keys = keys  # the app's: required of every route (None: none required)

    def models(self) -> Sequence[str]:
        return self._pool.models()

    def authorize(self, metadata: tuple[tuple[str, str], ...]) -> None:
        if self._keys is not None:
            self._keys.maybe_reload(_perf())
            auth = next((v for k, v in metadata if k == "authorization"), None)
            self._keys.authenticate(None if auth is None else auth.encode("latin-1"))

    def generate(self, spec: GenerateSpec, on_delta: OnDelta, on_end: OnEnd) -> _Handle:
        writer = DeltaWriter(on_delta, on_end)
        return _Handle(self.start(spec, writer, lambda sink, err: on_end(err), _SINK, _noop, _perf()))

    def start(self, spec: GenerateSpec, writer: Writer, fail: Fail, sink: ResponseSink, done: Callable[[], None],
              t0: float) -> Call:
        """``spec`` through the pipeline with ``writer`` on ``sink`` (the service's callbacks above; native
        ``Generate``'s framed messages straight to its HTTP/2 stream: :mod:`.native_generate`)."""
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in spec.metadata]
        body = _body(spec)
        chat = spec.messages is not None
        req = Request("POST", GRPC_ROUTE, "", headers, body, self._protocol, "grpc")
        timeout = None if spec.deadline is None else max(0.0, spec.deadline - _perf())
        return self._gen.start(req, lambda r: self._parse(chat, r), lambda g: writer, fail, sink, done, GRPC_ROUTE,
                               t0, timeout)

    def _parse(self, chat: bool, req: Request) -> GenerationRequest:
        g = self._api.parse(parse_chat if chat else parse_completion, req)
        g.stream = True  # the service streams deltas whatever the RPC; whole replies are joined there
        return g


_OPTIONAL = ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_tokens")


def _body(spec: GenerateSpec) -> bytes:
    """The spec as the OpenAI body it means: one parser validates both protocols."""
    d: dict[str, object] = {"model": spec.model}
    if spec.messages is not None:
        d["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
    else:
        d["prompt"] = spec.prompt or ""
    for key in _OPTIONAL:
        v = getattr(spec, key)
        if v is not None:
            d[key] = v
    if spec.stop:
        d["stop"] = list(spec.stop)
    if spec.logit_bias:
        d["logit_bias"] = {str(t): b for t, b in spec.logit_bias}
    return orjson.dumps(d)
