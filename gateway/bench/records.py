"""One request's record, and the reading of an OpenAI stream into it (sans-I/O).

Times are seconds on the run's clock (``time.perf_counter`` from the run's start). A
streamed response's *token times* are the times its chunks carrying text reached the
client: a chunk read in the same ``recv`` as another has the same time, as the user saw
it. From them, with the definitions of ``vllm bench serve``:

- TTFT: first text chunk - sent;  E2E: end of the response - sent;
- ITL: every gap between consecutive text chunks;
- TPOT: (E2E - TTFT) / (output tokens - 1), the first token excluded (none for one token).

A response that is not streamed has no token times: its first token reaches the client
with its last, so TTFT = E2E and it has no ITL or TPOT.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

__all__ = ["Record", "BodyReader", "SSEReader", "WholeReader", "ErrorReader", "read_whole_response", "settled"]


@dataclass(slots=True)
class Record:
    """A request as the client saw it; ``error`` is empty for a success, else its kind."""

    index: int
    scheduled: float  # when the arrival process asked for it
    start: float = 0.0  # when it was sent
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # the server's count (usage), else the client's estimate
    output_tokens: int = 0  # the server's count (usage), else text chunks received
    expected_output: int = 0
    error: str = ""
    detail: str = ""
    warmup: bool = False
    _last: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or not self.itl or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def token_at(self, t: float) -> None:
        """A chunk with text arrived at ``t``."""
        if self.ttft is None:
            self.ttft = t - self.start
        else:
            self.itl.append(t - self._last)
        self._last = t

    def fail(self, kind: str, detail: str = "") -> None:
        if not self.error:
            self.error, self.detail = kind, detail[:300]

    def to_json(self) -> dict[str, object]:
        return {"index": self.index, "scheduled": self.scheduled, "start": self.start, "end": self.end,
                "ttft": self.ttft, "itl": self.itl, "tpot": self.tpot, "e2e": self.e2e,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "expected_output": self.expected_output, "error": self.error, "detail": self.detail,
                "warmup": self.warmup}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Record:
        return cls(int(d["index"]), float(d["scheduled"]), float(d["start"]), float(d["end"]), d["ttft"],
                   list(d["itl"]), int(d["prompt_tokens"]), int(d["output_tokens"]), int(d["expected_output"]),
                   str(d["error"]), str(d["detail"]), bool(d["warmup"]))

_Errors = tuple[type[BaseException], ...]


@contextmanager
def settled(rec: Record, now: Callable[[], float], timeout: float, *, timeouts: _Errors = (TimeoutError,),
            lost: _Errors = (OSError, ConnectionError)) -> Iterator[None]:
    """A sender's request: a timeout or a lost connection inside is the record's error kind, and
    a record that failed has an end."""
    try:
        yield
    except timeouts:
        rec.fail("timeout", f"no complete response in {timeout:g} s")
    except lost as e:
        rec.fail("connection", str(e) or type(e).__name__)
    if rec.error and not rec.end:
        rec.end = now()


class BodyReader(Protocol):
    """A response body read as it arrives, into its record (sans-I/O: bytes and their time in)."""

    def feed(self, data: bytes, t: float) -> None: ...

    def finish(self, t: float) -> None:
        """The response ended at ``t``."""


def _usage(doc: dict[str, object], rec: Record) -> bool:
    u = doc.get("usage")
    if not isinstance(u, dict):
        return False
    rec.output_tokens = int(u.get("completion_tokens") or 0)
    rec.prompt_tokens = int(u.get("prompt_tokens") or rec.prompt_tokens)
    return True


class SSEReader:
    """Feed it an OpenAI server-sent event stream in any split, with the time of each piece."""

    __slots__ = ("rec", "buf", "done", "finished", "chunks", "has_usage")

    def __init__(self, rec: Record) -> None:
        self.rec = rec
        self.buf = b""
        self.done = False  # data: [DONE]
        self.finished = False  # a choice with a finish_reason (some servers send no [DONE] after it)
        self.chunks = 0
        self.has_usage = False

    def feed(self, data: bytes, t: float) -> None:
        buf = self.buf + data if self.buf else data
        start = 0
        while (i := buf.find(b"\n\n", start)) >= 0:
            self._event(buf[start:i], t)
            start = i + 2
        self.buf = buf[start:]

    def _event(self, ev: bytes, t: float) -> None:
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                return
            try:
                doc = orjson.loads(payload)
            except orjson.JSONDecodeError:
                self.rec.fail("bad_stream", payload[:200].decode(errors="replace"))
                return
            if "error" in doc:
                err = doc["error"]
                self.rec.fail("stream_error", str(err.get("message", err) if isinstance(err, dict) else err))
                return
            choices = doc.get("choices")
            if choices:
                c = choices[0]
                self.finished = self.finished or bool(c.get("finish_reason"))
                text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if text:
                    self.chunks += 1
                    self.rec.token_at(t)
            self.has_usage = _usage(doc, self.rec) or self.has_usage

    def finish(self, t: float) -> None:
        """The response ended at ``t``."""
        rec = self.rec
        rec.end = t
        if not (self.done or self.finished):
            rec.fail("incomplete_stream", "the stream ended without a finish_reason or data: [DONE]")
        if not self.has_usage:
            rec.output_tokens = self.chunks


class WholeReader:
    """A response that is not streamed: held until its end, then read by :func:`read_whole_response`."""

    __slots__ = ("rec", "body")

    def __init__(self, rec: Record) -> None:
        self.rec = rec
        self.body = bytearray()

    def feed(self, data: bytes, t: float) -> None:
        self.body += data

    def finish(self, t: float) -> None:
        read_whole_response(bytes(self.body), self.rec, t)


class ErrorReader:
    """A response whose HTTP status is not 200: the record fails as ``http_<status>`` with its body."""

    __slots__ = ("rec", "status", "body")

    def __init__(self, rec: Record, status: int) -> None:
        self.rec, self.status = rec, status
        self.body = bytearray()

    def feed(self, data: bytes, t: float) -> None:
        if len(self.body) < 300:
            self.body += data

    def finish(self, t: float) -> None:
        self.rec.end = t
        self.rec.fail(f"http_{self.status}", bytes(self.body[:300]).decode(errors="replace"))


def read_whole_response(body: bytes, rec: Record, t: float) -> None:
    """A non-streamed completion or chat completion (or an error body) ended at ``t``."""
    rec.end = t
    rec.ttft = t - rec.start
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        rec.fail("bad_response", body[:200].decode(errors="replace"))
        return
    if not isinstance(doc, dict) or not _usage(doc, rec):
        rec.fail("bad_response", "no usage in the response")
