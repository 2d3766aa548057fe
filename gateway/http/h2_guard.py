"""Bounds on what an HTTP/2 client can make the gateway do cheaply (sans-I/O, clock passed in).

How it works: :class:`H2FrameGuard` reads the frame headers of the client's bytes before h2
parses them (9 bytes a frame: length, type, flags, stream; payloads are skipped, never copied)
and answers with a :class:`Violation` once a connection must be closed with GOAWAY:

* **Header blocks are limited as they accumulate.** A HEADERS frame without END_HEADERS and
  the CONTINUATION frames after it count against ``max_header_bytes`` frame by frame, so a
  CONTINUATION flood (the CVE-2024-27316 class) is cut at the first frame past the limit,
  before h2 buffers it: memory stays within one limit, not the flood.
* **Rapid reset** (CVE-2023-44487): streams the client opens and then resets are counted
  against streams that completed. Past ``reset_allowance`` resets, a connection whose resets
  outnumber its completed streams ``reset_ratio`` to one is closed (nginx, Envoy and Go do
  the same: a client that resets what it opens is making the server work for nothing).
* **Cheap frames** (RST_STREAM, PING, SETTINGS, PRIORITY, empty DATA, WINDOW_UPDATE) draw on a
  token bucket per connection (``frame_rate`` a second, ``frame_burst`` at once): each costs
  the client a few bytes and the server a wake-up, so a connection that sends them faster
  than any real client would is closed. Each stream the connection completes adds
  ``stream_credit`` to the bucket: a busy client acknowledges every response with a
  WINDOW_UPDATE or two per stream and per connection, and at a thousand requests a second that
  alone passed the flat rate (found by ``quicserve bench``: httpx at ~900 req/s lost 63 of
  3,756 requests to GOAWAY). A flood earns nothing: it completes no streams.

HEADERS and non-empty DATA are the requests themselves, bounded elsewhere (stream limits,
body limits, admission).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["H2FrameGuard", "GuardLimits", "Violation"]

_DATA, _HEADERS, _PRIORITY, _RST, _SETTINGS, _PUSH, _PING, _GOAWAY, _WINDOW, _CONT = range(10)
_END_HEADERS = 0x4
# frames that cost us work and the peer nothing; GOAWAY too: a graceful one lets open streams
# finish (h2.py), so a peer could otherwise send them without end
_CHEAP = frozenset({_RST, _PING, _SETTINGS, _PRIORITY, _WINDOW, _GOAWAY})
_PREFACE = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n": not a frame


@dataclass(frozen=True, slots=True)
class GuardLimits:
    max_header_bytes: int = 16 << 10  # one header block, HEADERS + CONTINUATION payloads
    reset_allowance: int = 100  # resets a connection may always make
    reset_ratio: float = 2.0  # past the allowance: resets per completed stream before GOAWAY
    frame_rate: float = 1000.0  # cheap frames a second, sustained
    frame_burst: float = 2000.0  # cheap frames at once
    stream_credit: float = 4.0  # cheap frames each completed stream adds to the bucket (acks of its DATA)

    @classmethod
    def for_header_limit(cls, max_header_bytes: int) -> GuardLimits:
        """A block past ``max_header_bytes`` gets a 431 on its stream; one far past it (4x, at least
        64 KiB of compressed block) closes the connection."""
        return cls(max_header_bytes=max(4 * max_header_bytes, 65536))


@dataclass(frozen=True, slots=True)
class Violation:
    """Why the connection is closed (GOAWAY ENHANCE_YOUR_CALM, or COMPRESSION/PROTOCOL for headers)."""

    reason: str
    header_flood: bool = False


class H2FrameGuard:
    """One connection's frame accounting (server side: the client's frames)."""

    __slots__ = ("limits", "_skip", "_head", "_block", "_in_block", "resets", "completed", "_tokens", "_t",
                 "_preface")

    def __init__(self, limits: GuardLimits, now: float, *, preface: bool = True) -> None:
        self.limits = limits
        self._preface = _PREFACE if preface else 0  # client preface bytes still to pass over
        self._skip = 0  # payload bytes of the current frame still to pass over
        self._head = b""  # a frame header split across reads
        self._block = 0  # bytes of the header block being accumulated
        self._in_block = False
        self.resets = 0
        self.completed = 0
        self._tokens = limits.frame_burst
        self._t = now

    def stream_completed(self) -> None:
        """A stream the client opened got its whole response (what resets are measured against, and
        what earns the acknowledgements that follow it)."""
        self.completed += 1
        self._tokens = min(self.limits.frame_burst, self._tokens + self.limits.stream_credit)

    def feed(self, data: bytes, now: float) -> Violation | None:
        """Account for ``data`` (the client's next bytes); a Violation means: close now."""
        view = memoryview(data)
        pos, n = 0, len(view)
        if self._preface:
            k = min(self._preface, n)
            self._preface -= k
            pos = k
        while pos < n:
            if self._skip:
                k = min(self._skip, n - pos)
                self._skip -= k
                pos += k
                continue
            need = 9 - len(self._head)
            if n - pos < need:
                self._head += bytes(view[pos:])
                return None
            head = self._head + bytes(view[pos:pos + need]) if self._head else bytes(view[pos:pos + 9])
            self._head = b""
            pos += need
            length = int.from_bytes(head[:3], "big")
            v = self._frame(head[3], head[4], length, now)
            if v is not None:
                return v
            self._skip = length
        return None

    def _frame(self, ftype: int, flags: int, length: int, now: float) -> Violation | None:
        lim = self.limits
        if ftype == _HEADERS or (ftype == _CONT and self._in_block):
            self._block = length if ftype == _HEADERS else self._block + length
            self._in_block = not flags & _END_HEADERS
            if self._block > lim.max_header_bytes:
                return Violation(f"header block over {lim.max_header_bytes} bytes", header_flood=True)
            return None
        if ftype in _CHEAP or (ftype == _DATA and length == 0):
            self._tokens = min(lim.frame_burst, self._tokens + (now - self._t) * lim.frame_rate)
            self._t = now
            self._tokens -= 1
            if self._tokens < 0:
                return Violation(f"more than {lim.frame_rate:g} control frames a second")
            if ftype == _RST:
                self.resets += 1
                if self.resets > lim.reset_allowance and self.resets > lim.reset_ratio * max(1, self.completed):
                    return Violation(f"{self.resets} streams reset against {self.completed} completed")
        return None
