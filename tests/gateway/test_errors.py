"""Every kind of error the one model makes, through every wire format that renders it (issue #27).

A kind is an :class:`~gateway.errors.APIError` as its producer makes it (adapters, admission,
routing, workers, a crash); a renderer is one place that puts an error on the wire: the HTTP JSON
response (:func:`~gateway.errors.render_http`, the HTTP/1.1 adapter's own rejection, a coroutine
route that raises), the SSE error event, native gRPC (trailers-only, the trailers after a stream,
the service path) and gRPC-Web (the trailer frame, before and after a message). Each must show the
client the same message, a status that maps the same way, and the same ``retry-after``: whole
seconds rounded up, at least 1. The expected gRPC code and ``retry-after`` of each kind are worked
out by hand in the table, not computed by the code under test.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson
import pytest

from gateway.errors import APIError, from_routing, from_wire_code, internal_error, render_http, render_sse
from gateway.grpc.compression import Codecs
from gateway.grpc.grpc_web_route import serve_web_call
from gateway.grpc.native import NativeResponseWriter
from gateway.grpc.native_frame_writer import GrpcFrameWriter
from gateway.grpc.native_route import NativeRoute
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.grpc.service import InferenceService
from gateway.grpc.status import Status, decode_grpc_message
from gateway.http.common import protocol_error, task_entrance
from gateway.http.h1_core import error_response
from gateway.http.types import Headers, Request, ResponseSink
from gateway.routing.errors import NoReplica, UnknownModel
from tests.gateway.grpc.backend_double import EchoBackendDouble
from tests.gateway.grpc.web_client import frame, parse_body
from transport.messages import ErrorCode

pytestmark = pytest.mark.timeout(30)

GENERATE = "/quicserve.v1.Inference/Generate"


@dataclass(frozen=True)
class Kind:
    """An error (``None``: an unexpected exception), its gRPC code and ``retry-after`` (by hand)."""

    err: APIError | None
    grpc: Status
    retry_after: str | None = None

    @property
    def seen_as(self) -> APIError:
        """What a client must be told: the error, or for a crash the one internal error."""
        return internal_error() if self.err is None else self.err


def _e(status: int, message: str, retry_after: float | None = None, code: str | None = None) -> APIError:
    return APIError(status, message, "server_error" if status >= 500 else "invalid_request_error", None, code,
                    retry_after, ((b"x-ratelimit-limit-requests", b"10"),) if status == 429 else ())


KINDS = {
    "400 invalid value": Kind(APIError(400, "`temperature` must be at most 2.", "invalid_request_error",
                                       "temperature", "invalid_value"), Status.INVALID_ARGUMENT),
    "400 message to percent-encode": Kind(_e(400, "bad température: 100%\r\nnext"), Status.INVALID_ARGUMENT),
    "401 no key": Kind(_e(401, "Missing API key.", code="invalid_api_key"), Status.UNAUTHENTICATED),
    "403 model not allowed": Kind(_e(403, "This key may not use `tiny`.", code="model_not_allowed"),
                                  Status.PERMISSION_DENIED),
    "404 unknown model": Kind(from_routing(UnknownModel("gpt-9")), Status.NOT_FOUND),
    "408 body timeout": Kind(protocol_error(408, "The request body stopped arriving."), Status.DEADLINE_EXCEEDED),
    "413 body too large": Kind(protocol_error(413, "The request body is over 4096 bytes."),
                               Status.RESOURCE_EXHAUSTED),
    "415 content type": Kind(_e(415, "content-type must be application/json"), Status.INVALID_ARGUMENT),
    "429 in 1.2 s": Kind(_e(429, "Rate limit reached; retry in 1.2 s.", 1.2), Status.RESOURCE_EXHAUSTED, "2"),
    "429 in 2.5 s": Kind(_e(429, "Rate limit reached; retry in 2.5 s.", 2.5), Status.RESOURCE_EXHAUSTED, "3"),
    "429 in 0.2 s": Kind(_e(429, "Rate limit reached; retry in 0.2 s.", 0.2), Status.RESOURCE_EXHAUSTED, "1"),
    "429 in 0 s": Kind(_e(429, "Rate limit reached; retry now.", 0.0), Status.RESOURCE_EXHAUSTED, "1"),
    "429 never fits": Kind(_e(429, "Request too large for the limit."), Status.RESOURCE_EXHAUSTED),
    "431 headers too large": Kind(protocol_error(431, "Request headers too large."), Status.INVALID_ARGUMENT),
    "499 cancelled": Kind(from_wire_code(ErrorCode.CANCELLED, "cancelled"), Status.CANCELLED),
    "500 internal": Kind(internal_error(), Status.INTERNAL),
    "500 crash": Kind(None, Status.INTERNAL),
    "502 worker lost": Kind(from_wire_code(ErrorCode.CONNECTION_LOST, "worker went away"), Status.UNAVAILABLE),
    "503 no worker": Kind(from_routing(NoReplica("tiny")), Status.UNAVAILABLE, "1"),
    "503 queue full": Kind(_e(503, "The server is overloaded; retry shortly.", code="overloaded"),
                           Status.UNAVAILABLE),
    "503 draining in 3 s": Kind(_e(503, "Shutting down.", 3.0, "shutting_down"), Status.UNAVAILABLE, "3"),
    "504 deadline": Kind(from_wire_code(ErrorCode.TIMEOUT, "Request timed out."), Status.DEADLINE_EXCEEDED),
    # every worker error code, as from_wire_code renders it (its 503s say when to retry)
    **{f"worker {c.name}": Kind(from_wire_code(c, f"worker said {c.name}"), g,
                                "1" if c in (ErrorCode.OVERLOADED, ErrorCode.SHUTTING_DOWN) else None) for c, g in [
        (ErrorCode.INTERNAL, Status.INTERNAL), (ErrorCode.INVALID_REQUEST, Status.INVALID_ARGUMENT),
        (ErrorCode.UNKNOWN_MODEL, Status.NOT_FOUND), (ErrorCode.OVERLOADED, Status.UNAVAILABLE),
        (ErrorCode.CANCELLED, Status.CANCELLED), (ErrorCode.CONTEXT_LENGTH, Status.INVALID_ARGUMENT),
        (ErrorCode.SHUTTING_DOWN, Status.UNAVAILABLE), (ErrorCode.CONNECTION_LOST, Status.UNAVAILABLE),
        (ErrorCode.PROTOCOL, Status.UNAVAILABLE), (ErrorCode.TIMEOUT, Status.DEADLINE_EXCEEDED)]},
}


def test_the_table_has_every_worker_error_code() -> None:
    named = {k.removeprefix("worker ") for k in KINDS if k.startswith("worker ")}
    assert named == {c.name for c in ErrorCode}


@dataclass(frozen=True)
class Seen:
    """What a client read of one error: the status (HTTP, or the gRPC code), message, retry-after."""

    status: int
    message: str
    retry_after: str | None


class _Sink:
    """A ResponseSink that keeps what was written (trailers too)."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: Headers = []
        self.body = b""
        self.trailers: Headers | None = None

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.status, self.headers, self.body = status, list(headers), body

    def start(self, status: int, headers: Headers) -> None:
        self.status, self.headers = status, list(headers)

    def send_nowait(self, data: bytes) -> bool:
        self.body += data
        return True

    async def send(self, data: bytes) -> None:
        self.body += data

    def end(self, trailers: Headers | None = None) -> None:
        self.trailers = trailers

    def abort(self) -> None:
        raise AssertionError("an error before the response started must be rendered, not cut")


def _http(status: int, headers: Headers, body: bytes, err: APIError) -> Seen:
    h = dict(headers)
    assert h[b"content-type"] == b"application/json"
    assert all(h.get(k) == v for k, v in err.headers)  # the error's own headers (x-ratelimit-*) go along
    e = orjson.loads(body)["error"]
    assert (e["type"], e["code"], e["param"]) == (err.type, err.code, err.param)
    retry = h.get(b"retry-after")
    return Seen(status, e["message"], None if retry is None else retry.decode())


def _grpc(pairs: Headers | dict[str, str]) -> Seen:
    t = {k.decode(): v.decode() for k, v in pairs} if isinstance(pairs, list) else pairs
    return Seen(int(t["grpc-status"]), decode_grpc_message(t.get("grpc-message", "")), t.get("retry-after"))


# -- the renderers: an error (None: a crash) in, what the client saw out ------------------------------

def _render_http(err: APIError) -> Seen:
    return _http(*render_http(err), err)


def _h1_rejection(err: APIError) -> Seen:
    head, body = error_response(err, b"Thu, 01 Jan 2026 00:00:00 GMT").split(b"\r\n\r\n", 1)
    status_line, *lines = head.split(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 ")
    headers = [(k.lower(), v) for k, v in (line.split(b": ", 1) for line in lines)]
    assert (b"connection", b"close") in headers and (b"content-length", b"%d" % len(body)) in headers
    return _http(int(status_line.split()[1]), headers, body, err)


async def _route_raises(err: APIError | None) -> Seen:
    async def handler(request: Request, sink: ResponseSink) -> None:
        raise RuntimeError("a bug") if err is None else err

    return await _route(handler, err)


async def _route(handler: Callable[[Request, ResponseSink], Awaitable[None]], err: APIError | None) -> Seen:
    sink, ended = _Sink(), asyncio.Event()
    task_entrance(handler)(Request("POST", "/x", "", [], b"", "h2", "http"), sink, ended.set)
    await asyncio.wait_for(ended.wait(), 5)
    assert sink.status is not None
    return _http(sink.status, sink.headers, sink.body, err or internal_error())


def _sse(err: APIError) -> Seen:
    event = render_sse(err)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    e = orjson.loads(event[6:])["error"]
    assert (e["type"], e["code"], e["param"]) == (err.type, err.code, err.param)
    assert "retry_after" not in e  # sent after the response head: the event has no retry-after to give
    return Seen(e["status"], e["message"], None)


def _native_trailers_only(err: APIError) -> Seen:
    w = GrpcFrameWriter(NativeResponseWriter(None, Codecs().accept_encoding))
    status, headers, body = w.error(err)
    assert (status, body, w.trailers) == (200, b"", None)
    assert dict(headers)[b"content-type"] == b"application/grpc"
    return _grpc(headers)


def _native_stream_end(err: APIError) -> Seen:
    w = GrpcFrameWriter(NativeResponseWriter(None, Codecs().accept_encoding))
    assert w.text(b"hi") and w.stream_error(err) == b""
    assert w.trailers is not None
    return _grpc(w.trailers)


class _CrashingBackend(EchoBackendDouble):
    def generate(self, *args: object) -> object:  # type: ignore[override]
        raise RuntimeError("a bug in the backend")


def _backend(err: APIError | None, after_a_message: bool) -> EchoBackendDouble:
    if err is None:
        return _CrashingBackend()
    backend = EchoBackendDouble()
    if after_a_message:
        backend.hang_after, backend.fail = 1, err
    else:
        backend.reject = err
    return backend


def _request(prompt: str) -> bytes:
    return frame(pb.GenerateRequest(model="tiny", prompt=prompt).SerializeToString())


async def _native_service(err: APIError | None, after_a_message: bool = False) -> Seen:
    route = NativeRoute(InferenceService(_backend(err, after_a_message)).__mapping__(), Codecs(), 1 << 16)
    sink = _Sink()
    await route(Request("POST", GENERATE, "", [(b"content-type", b"application/grpc")], _request("a b"), "h2",
                        "http"), sink)
    assert sink.status == 200 and sink.trailers is not None
    assert bool(sink.body) == (after_a_message and err is not None)
    return _grpc(sink.trailers)


class _WebSink:
    """A gRPC-Web call's sink: its headers, then its body bytes."""

    def __init__(self) -> None:
        self.headers: Headers = []
        self.body = b""

    async def start(self, headers: Headers) -> None:
        self.headers = headers

    async def write(self, data: bytes) -> None:
        self.body += data


async def _web(err: APIError | None, after_a_message: bool = False) -> Seen:
    service = InferenceService(_backend(err, after_a_message))

    sink = _WebSink()

    async def body() -> AsyncIterator[bytes]:
        yield _request("a b")

    await serve_web_call(service.__mapping__(), GENERATE, {b"content-type": b"application/grpc-web+proto"},
                         body(), sink, Codecs(), 1 << 16)
    got = parse_body(sink.body, None)
    assert len(got.messages) == (1 if after_a_message and err is not None else 0)
    return _grpc(got.trailers)


def _sync(render: Callable[[APIError], Seen]) -> Callable[[APIError | None], Awaitable[Seen] | Seen]:
    return lambda err: render(internal_error() if err is None else err)


def _mid(render: Callable[..., Awaitable[Seen]]) -> Callable[[APIError | None], Awaitable[Seen]]:
    return lambda err: render(err, after_a_message=True)


HTTP = {"http json": _sync(_render_http), "h1 rejection": _sync(_h1_rejection), "route raises": _route_raises}
SSE = {"sse event": _sync(_sse)}
GRPC = {"native trailers-only": _sync(_native_trailers_only), "native stream end": _sync(_native_stream_end),
        "native service": _native_service, "native service mid-stream": _mid(_native_service),
        "grpc-web": _web, "grpc-web mid-stream": _mid(_web)}


async def _seen(render: Callable[[APIError | None], Awaitable[Seen] | Seen], err: APIError | None) -> Seen:
    out = render(err)
    return await out if not isinstance(out, Seen) else out


@pytest.mark.parametrize("renderer", [*HTTP, *SSE, *GRPC])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_every_error_kind_through_every_renderer(kind: str, renderer: str) -> None:
    k = KINDS[kind]
    want = k.seen_as
    if renderer in HTTP:
        seen = await _seen(HTTP[renderer], k.err)
        assert seen == Seen(want.status, want.message, k.retry_after)
    elif renderer in SSE:
        seen = await _seen(SSE[renderer], k.err)
        assert seen == Seen(want.status, want.message, None)
    else:
        seen = await _seen(GRPC[renderer], k.err)
        assert seen == Seen(k.grpc.value, want.message, k.retry_after)


async def test_a_crash_reads_the_same_on_http_and_grpc() -> None:
    """One wording for an unexpected exception, whichever protocol carried the request."""
    http = await _route_raises(None)
    grpc_web, native = await _web(None), await _native_service(None)
    assert http.message == grpc_web.message == native.message == internal_error().message


async def test_a_route_that_never_answers_gets_the_internal_error() -> None:
    async def handler(request: Request, sink: ResponseSink) -> None:
        pass

    assert await _route(handler, None) == Seen(500, internal_error().message, None)
