"""HTTP/1.1 as a sans-I/O core: request bytes in, events out; response framing as bytes.

How it works: :meth:`H1Core.receive` feeds bytes to httptools (llhttp), whose callbacks
collect one message at a time; each complete message becomes a :class:`RequestReceived`, a
client waiting for ``100 Continue`` a :class:`ContinueExpected`, and input we refuse a
:class:`Rejected` carrying the :class:`~gateway.errors.APIError` to answer with. After a
rejection or a request that ends the connection (``connection: close``, HTTP/1.0 without
keep-alive, an Upgrade) the core is :attr:`~H1Core.closed` and ignores further input. No
I/O and no clock: the caller passes ``now``, reads :attr:`~H1Core.deadline` (header or
body-stall deadline of the message being read, ``inf`` between messages) and calls
:meth:`~H1Core.expire` once it has passed.

Header rules llhttp leaves to us are checked as headers arrive: exactly one Host (none is
fine in HTTP/1.0) with a valid value, else 400 (RFC 9112 3.2); a transfer coding other than
``chunked`` is a 501 (RFC 9112 6.1) -- ``chunked`` missing, not last or twice is llhttp's
400 (6.3). Both end the connection like any other protocol error: a client that disagrees
with us about one message (a smuggling shape behind a proxy) may disagree about the next.

The output half is plain functions: a response head, chunk framing, and an error response
rendered by :mod:`gateway.errors` (the one renderer).
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from math import inf
from typing import NoReturn

import httptools

from gateway.errors import APIError, error_headers, render_json
from gateway.http.common import HOST_CHARS, HttpLimits, decode_target, protocol_error
from gateway.http.types import Headers, Request

__all__ = [
    "H1Core",
    "RequestReceived",
    "ContinueExpected",
    "Rejected",
    "Event",
    "IDLE",
    "HEADERS",
    "BODY",
    "response_head",
    "error_response",
    "content_length",
    "chunk_head",
    "CHUNKED",
    "CLOSE",
    "KEEP_ALIVE",
    "END_HEAD",
    "LAST_CHUNK",
    "CONTINUE",
]

IDLE, HEADERS, BODY = 0, 1, 2  # H1Core.state: between messages, reading a head, reading a body


@dataclass(slots=True)
class RequestReceived:
    # Not frozen, unlike the other events: made once per request, and a frozen dataclass's
    # __init__ (object.__setattr__ per field) costs ~0.6 µs more, a tenth of h1's CPU per request.
    request: Request
    keep_alive: bool  # False: answer with connection: close, then close
    http10: bool  # no chunked coding in the response


@dataclass(frozen=True, slots=True)
class ContinueExpected:
    """The request just read sent ``Expect: 100-continue`` and waits before its body."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """Input we refuse: answer ``error`` with ``connection: close`` once it is this one's turn."""

    error: APIError


Event = RequestReceived | ContinueExpected | Rejected
_CONTINUE_EXPECTED = ContinueExpected()


class _Stop(Exception):
    """Raised inside a parser callback to abandon the message."""


class _NoCallbacks:
    """The protocol of a parser that parses nothing (see :meth:`H1Core.release`)."""


_DETACHED = httptools.HttpRequestParser(_NoCallbacks())


class H1Core:
    """Request parsing for one HTTP/1.1 connection."""

    def __init__(
        self, limits: HttpLimits, *, scheme: str = "http", client: tuple[str, int] | None = None
    ) -> None:
        self.limits = limits
        self.scheme = scheme
        self.client = client
        self.state = IDLE
        self.deadline = inf  # when the message being read times out (408)
        self.closed = False  # nothing more is parsed
        self._parser = httptools.HttpRequestParser(self)
        self._events: list[Event] = []
        self._now = 0.0
        self._msg_seq = 0
        self._url = b""
        self._headers: Headers = []
        self._hdr_bytes = 0
        self._hdr_raw = 0
        self._body: list[bytes] = []
        self._body_len = 0
        self._content_length = -1
        self._chunked = False
        self._upgrade_left = 0
        self._expect = False
        self._method = ""
        self._path = ""
        self._query = ""
        self._hosts = 0
        self._fail_with: APIError | None = None

    def release(self) -> None:
        """The connection is gone: drop the parser, which holds bound methods of this core (a
        reference cycle per connection that only the cyclic collector would free), and parse
        nothing more."""
        self.closed = True
        self._parser = _DETACHED
        self._events.clear()

    def receive(self, data: bytes, now: float) -> list[Event]:
        """Feed bytes from the client; the events they complete, in order."""
        self._now = now
        events = self._events = []
        if self._upgrade_left:
            self._upgrade_body(data)
            return events
        if self.closed:
            return events
        seq = self._msg_seq
        was_headers = self.state == HEADERS
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # We do not switch protocols on Upgrade (h2c upgrade, websocket): the request is
            # answered as HTTP/1.1 and the connection then closes.
            self.closed = True
            if self._upgrade_left:
                self._upgrade_body(data[int(exc.args[0]) :])
            return events
        except httptools.HttpParserError as exc:
            if self.closed:  # llhttp's "data after Connection: close": ignored, however it was split
                return events
            fail, self._fail_with = self._fail_with, None
            self._reject(fail or protocol_error(400, f"malformed HTTP request: {exc}"))
            return events
        if was_headers and self.state == HEADERS and seq == self._msg_seq:
            self._hdr_raw += len(data)  # httptools buffers a header until it ends
            if self._hdr_raw > self.limits.max_header_bytes:
                self._reject(protocol_error(431, "request headers too large"))
        return events

    def expire(self, now: float) -> Rejected | None:
        """The 408 for a message whose deadline has passed by ``now`` (None if it has not)."""
        if self.closed or self.state == IDLE or now < self.deadline:
            return None
        what = "request headers" if self.state == HEADERS else "request body"
        self._events = []
        self._reject(protocol_error(408, f"timed out waiting for {what}"))
        (event,) = self._events
        assert isinstance(event, Rejected)
        return event

    def _reject(self, err: APIError) -> None:
        self.closed = True
        self.deadline = inf
        self._events.append(Rejected(err))

    def _stop(self, status: int, message: str, code: str | None = None) -> NoReturn:
        self._fail_with = protocol_error(status, message, code)
        raise _Stop(message)

    # ---- httptools callbacks ----------------------------------------------
    def on_message_begin(self) -> None:
        self.state = HEADERS
        self._msg_seq += 1
        self._url = b""
        self._headers = []
        self._hdr_bytes = self._hdr_raw = 0
        self._body = []
        self._body_len = 0
        self._content_length = -1
        self._chunked = False
        self._upgrade_left = 0
        self._expect = False
        self._hosts = 0
        self.deadline = self._now + self.limits.header_timeout

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._hdr_bytes += len(url)
        if self._hdr_bytes > self.limits.max_header_bytes:
            self._stop(431, "request target and headers too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self.limits
        self._hdr_bytes += len(name) + len(value) + 4
        if self._hdr_bytes > limits.max_header_bytes:
            self._stop(431, "request headers too large")
        name = name.lower()
        if name == b"host":
            self._hosts += 1
            if value.translate(None, HOST_CHARS):  # anything left is not uri-host [":" port]
                self._stop(400, "invalid Host header")
        if not value.isascii():
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                self._stop(400, "invalid UTF-8 in request header")
        if name == b"content-length":
            try:
                self._content_length = int(value)
            except ValueError:
                self._stop(400, "invalid content-length")
            if self._content_length > limits.max_body_bytes:
                self._stop(413, f"request body exceeds {limits.max_body_bytes} bytes")
        elif name == b"expect" and value.lower() == b"100-continue":
            self._expect = True
        elif name == b"transfer-encoding":
            self._chunked = True  # llhttp has checked it is valid (chunked last)
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._hosts != 1:
            if self._hosts:
                self._stop(400, "more than one Host header")
            if self._parser.get_http_version() != "1.0":
                self._stop(400, "HTTP/1.1 request without a Host header")
        if self._chunked:
            self._check_codings()
        raw_path, _, raw_query = self._url.partition(b"?")
        if not raw_path.startswith(b"/") and raw_path != b"*":  # absolute-form: keep only the path
            try:
                url = httptools.parse_url(self._url)
            except httptools.HttpParserInvalidURLError:
                self._stop(400, "invalid request target")
            raw_path, raw_query = url.path or b"/", url.query or b""
        try:
            self._path = decode_target(raw_path)
            self._query = raw_query.decode("utf-8")
        except UnicodeDecodeError:
            self._stop(400, "invalid UTF-8 in request target")
        self._method = self._parser.get_method().decode("ascii")
        self.state = BODY
        self.deadline = self._now + self.limits.body_timeout
        if self._expect and self._parser.get_http_version() == "1.1":
            self._events.append(_CONTINUE_EXPECTED)

    def _check_codings(self) -> None:
        """llhttp accepts any codings before a final ``chunked`` and hands the body over still
        coded; we decode none of them."""
        codings = [
            c.split(b";", 1)[0].strip(b" \t").lower()
            for k, v in self._headers
            if k == b"transfer-encoding"
            for c in v.split(b",")
        ]
        codings = [c for c in codings if c]
        if codings[-1:] != [b"chunked"] or codings.count(b"chunked") > 1:
            self._stop(400, "transfer-encoding must end in chunked, once")  # RFC 9112 6.3
        if len(codings) > 1:
            self._stop(
                501,
                f"transfer-coding {codings[0].decode('ascii', 'replace')!r} is not supported; "
                "send the body with chunked alone or with content-length",
                "unsupported_transfer_encoding",
            )

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self.limits.max_body_bytes:
            self._stop(413, f"request body exceeds {self.limits.max_body_bytes} bytes")
        self._body.append(body)
        self.deadline = self._now + self.limits.body_timeout

    def on_message_complete(self) -> None:
        parser = self._parser
        if (self._content_length > 0 or self._chunked) and not self._body_len and parser.should_upgrade():
            # llhttp hands everything after an Upgrade request's headers to the "new
            # protocol", body included. We never upgrade (RFC 9110 lets a server ignore it),
            # so read a declared body ourselves.
            if self._chunked:
                self._stop(400, "chunked body on an Upgrade request is not supported")
            self._upgrade_left = self._content_length
            return
        self._complete(parser.should_keep_alive() and not parser.should_upgrade())

    def _complete(self, keep_alive: bool) -> None:
        parts = self._body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        request = Request(
            self._method, self._path, self._query, self._headers, body, "http/1.1", self.scheme, self.client
        )
        self.state = IDLE
        self.deadline = inf
        if not keep_alive:
            self.closed = True
        self._events.append(RequestReceived(request, keep_alive, self._parser.get_http_version() == "1.0"))

    def _upgrade_body(self, data: bytes) -> None:
        take = data[: self._upgrade_left]
        if take:
            self._body.append(take)
            self._body_len += len(take)
            self._upgrade_left -= len(take)
            self.deadline = self._now + self.limits.body_timeout
        if not self._upgrade_left:
            self._complete(False)


# ---- output ---------------------------------------------------------------
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
CHUNKED = b"transfer-encoding: chunked\r\n"
CLOSE = b"connection: close\r\n\r\n"  # ends a head: the connection closes after this response
KEEP_ALIVE = b"connection: keep-alive\r\n\r\n"  # ends an HTTP/1.0 head that keeps the connection
END_HEAD = b"\r\n"
LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        _STATUS_LINES[status] = line
    return line


def response_head(status: int, headers: Headers, date: bytes, framing: bytes, end: bytes) -> list[bytes]:
    """The pieces of a response head: status line, ``date``, ``headers``, ``framing``
    (:func:`content_length`, :data:`CHUNKED` or nothing) and ``end`` (:data:`END_HEAD`,
    :data:`CLOSE` or :data:`KEEP_ALIVE`)."""
    buf = [_status_line(status), b"date: ", date, b"\r\n"]
    if len(headers) < 3:
        for k, v in headers:
            buf += (k, b": ", v, b"\r\n")
    else:  # joined in C: about 0.7k instructions a header against the loop's 1.2k, but 1.6k more for one
        buf.append(b"\r\n".join(map(_name_value, headers)))
        buf.append(b"\r\n")
    buf.append(framing)
    buf.append(end)
    return buf


_name_value = b": ".join  # (name, value) -> b"name: value"


def content_length(n: int) -> bytes:
    return b"content-length: %d\r\n" % n


def chunk_head(n: int) -> bytes:
    """What goes before ``n`` bytes of chunked body (``\\r\\n`` goes after them)."""
    return b"%x\r\n" % n


def error_response(err: APIError, date: bytes) -> bytes:
    """A whole error response that closes the connection."""
    body = render_json(err)
    return (
        b"".join(response_head(err.status, error_headers(err), date, content_length(len(body)), CLOSE)) + body
    )
