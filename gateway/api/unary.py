"""Non-streaming generation without a task: the hot path of the two generation routes.

Why: on Python 3.11 a request served in its own task pays for the Task, its entry
in asyncio's task WeakSet, a ``call_soon`` for the first step, a future for the
result, a resumption through every coroutine frame of the handler chain, and a done
callback -- measured at about a tenth of the gateway's CPU for a short
non-streaming request. Such a request needs none of that: it parses, submits,
and waits for one event, the transport's collected result. :class:`UnaryCall`
runs it as two callbacks.

The protocol adapter offers the path as ``App.fast(request, sink, done)`` (the
contract is :data:`gateway.http.types.FastHandler`). Only plain non-streaming
requests that parse and find a worker take it; streams, logprobs and every
request that fails before its submit go the task path, which stays the
reference behaviour (the fast path answers exactly as ``_unary_plain`` does;
tests run both).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..errors import APIError, error_headers, render_json
from ..routing.pool import RoutedStream
from .params import GenerationRequest
from .render import JSON_HEADERS

if TYPE_CHECKING:
    from .openai import OpenAIHandlers

__all__ = ["UnaryCall"]

log = logging.getLogger("quicserve.api")

Respond = Callable[[int, list[tuple[bytes, bytes]], bytes], None]


class UnaryCall:
    """One non-streaming generation, driven by the transport's completion callback.

    Ends exactly once (:meth:`_end`): with the response, an error response, a 504
    when the request deadline cancels it, or 499 (nothing sent) when the client
    goes away. Then ``on_end(status)`` (the app's metrics) and ``done()`` (the
    adapter's next request) run, in that order.
    """

    __slots__ = ("_h", "_g", "_routed", "_respond", "_t0", "_route", "_on_end", "_done", "_ended")

    def __init__(self, h: OpenAIHandlers, g: GenerationRequest, routed: RoutedStream, respond: Respond,
                 t0: float, route: str, on_end: Callable[[int], None], done: Callable[[], None]) -> None:
        self._h = h
        self._g = g
        self._routed = routed
        self._respond = respond
        self._t0 = t0
        self._route = route
        self._on_end = on_end
        self._done = done
        self._ended = False

    def start(self) -> None:
        self._h.deadlines.add(self, self._h.api.request_timeout)
        self._wait(self._routed.collect_nowait())

    def _wait(self, fut: Awaitable[Any]) -> None:
        fut.add_done_callback(self._collected)  # type: ignore[attr-defined]

    def _collected(self, fut: Any) -> None:
        if self._ended or fut.cancelled():
            return
        try:
            res = fut.result()
            if self._routed.retry(res):  # a worker failed before any token: it moved to another
                self._wait(self._routed.collect_nowait())
                return
            self._respond(200, JSON_HEADERS, self._h.whole_response(self._g, self._route, res))
            status = 200
        except APIError as e:
            status = self._error(e)
        except Exception:
            log.exception("unhandled error in %s", self._route)
            status = self._error(APIError(500, "Internal server error.", "server_error", None, "internal_error"))
        self._end(status)

    def _error(self, e: APIError) -> int:
        self._respond(e.status, error_headers(e), render_json(e))
        return e.status

    # -- the Call contract, and what the deadline sweeper needs of a task ---------------
    def cancel(self) -> bool:
        if self._ended:
            return False
        if self._h.deadlines.expired(self):
            self._end(self._error(self._h._timeout()))
        else:
            self._end(499)  # the client went away; nothing to send
        return True

    def done(self) -> bool:
        return self._ended

    def uncancel(self) -> int:
        return 0

    def _end(self, status: int) -> None:
        self._ended = True
        self._h.deadlines.discard(self)
        if not self._routed.done:
            self._routed.cancel()
        try:
            self._on_end(status)
        finally:
            self._done()
