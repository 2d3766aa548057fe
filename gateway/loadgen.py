"""The developers' HTTP/1.1 load generator (closed loop, keep-alive) of the benchmarks in tests/bench/.

Users' serving benchmark is ``quicserve bench`` (:mod:`gateway.bench`); this one stays as small as it
is so that the gateway benchmarks' client costs the same from run to run.

Each of ``concurrency`` connections sends one pre-rendered request, waits for
the whole response (content-length or chunked; an SSE stream must end with
``data: [DONE]``), records the latency and sends the next. The work can be
spread over several processes (``--processes``) so the client is not the
bottleneck; each child prints its raw latencies as JSON and the parent merges.

    python -m gateway.loadgen --url http://127.0.0.1:8080 --concurrency 32 --duration 10 [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field

import orjson

__all__ = ["LoadResult", "run_load", "main", "chat_request"]


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0
    first_error: str = ""

    @property
    def requests(self) -> int:
        return len(self.latencies)

    def percentile(self, p: float) -> float:
        if not self.latencies:
            return float("nan")
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(p / 100 * len(s)))]

    def merge(self, other: LoadResult) -> None:
        self.latencies += other.latencies
        self.errors += other.errors
        self.elapsed = max(self.elapsed, other.elapsed)
        self.first_error = self.first_error or other.first_error


def chat_request(host: str, port: int, *, stream: bool, max_tokens: int, model: str = "tiny",
                 path: str = "/v1/chat/completions", api_key: str = "") -> bytes:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Hello there"}],
                         "max_tokens": max_tokens, "stream": stream})
    if path != "/v1/chat/completions":
        return f"GET {path} HTTP/1.1\r\nhost: {host}:{port}\r\n\r\n".encode()
    auth = f"authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n{auth}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class _Client(asyncio.Protocol):
    """One keep-alive connection; ``await request()`` returns the response body or raises."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.fut: asyncio.Future[tuple[int, bytes]] | None = None
        self.head_len = -1
        self.status = 0
        self.clen = -1
        self.chunked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"connection lost: {exc}"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.head_len < 0:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                return
            self.head_len = i + 4
            head = bytes(buf[:i]).lower()
            self.status = int(head[9:12])
            j = head.find(b"content-length:")
            if j >= 0:
                k = head.find(b"\r\n", j)
                self.clen = int(head[j + 15: k if k > 0 else len(head)])
            self.chunked = b"transfer-encoding: chunked" in head
        body_len = len(buf) - self.head_len
        if self.chunked:
            if not buf.endswith(b"0\r\n\r\n"):
                return
        elif body_len < self.clen:
            return
        body = bytes(buf[self.head_len:])
        buf.clear()
        self.head_len, self.clen, self.chunked = -1, -1, False
        if self.fut is not None and not self.fut.done():
            self.fut.set_result((self.status, body))

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.fut = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(raw)
        return await self.fut


async def run_load(url: str, *, concurrency: int, duration: float, stream: bool, max_tokens: int,
                   path: str = "/v1/chat/completions", model: str = "tiny", api_key: str = "") -> LoadResult:
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    raw = chat_request(host, port, stream=stream, max_tokens=max_tokens, path=path, model=model, api_key=api_key)
    loop = asyncio.get_running_loop()
    result = LoadResult()
    end = time.perf_counter() + duration

    async def one() -> None:
        _, client = await loop.create_connection(_Client, host, port)
        perf = time.perf_counter
        try:
            while True:
                t = perf()
                if t >= end:
                    return
                status, body = await client.request(raw)
                if status != 200 or (stream and not body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")):
                    result.errors += 1
                    result.first_error = result.first_error or f"{status}: {body[:200]!r}"
                    continue
                result.latencies.append(perf() - t)
        finally:
            assert client.transport is not None
            client.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(concurrency)))
    result.elapsed = time.perf_counter() - t0
    return result


def _child_argv(a: argparse.Namespace, concurrency: int, out: str) -> list[str]:
    argv = [sys.executable, "-m", "gateway.loadgen", "--url", a.url, "--concurrency", str(concurrency),
            "--duration", str(a.duration), "--max-tokens", str(a.max_tokens), "--path", a.path,
            "--model", a.model, "--processes", "1", "--raw-out", out, "--api-key", a.api_key]
    return argv + (["--stream"] if a.stream else [])


def run_processes(a: argparse.Namespace) -> LoadResult:
    """Split the connections over ``a.processes`` child processes and merge their results."""
    per = [a.concurrency // a.processes + (1 if i < a.concurrency % a.processes else 0) for i in range(a.processes)]
    total = LoadResult()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(c, os.path.join(tmp, f"{i}.json")) for i, c in enumerate(per) if c]
        procs = [(subprocess.Popen(_child_argv(a, c, out)), out) for c, out in jobs]
        for p, out in procs:
            p.wait(timeout=a.duration + 60)
            if p.returncode != 0:
                raise RuntimeError(f"load generator child failed with status {p.returncode}")
            with open(out, "rb") as f:
                d = orjson.loads(f.read())
            total.merge(LoadResult(d["latencies"], d["errors"], d["elapsed"], d["first_error"]))
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--model", default="tiny")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--api-key", default="", help="sent as Authorization: Bearer")
    p.add_argument("--raw-out", help=argparse.SUPPRESS)  # child mode: write raw results (JSON) here
    a = p.parse_args(argv)
    if a.processes > 1:
        r = run_processes(a)
    else:
        import uvloop

        r = uvloop.run(run_load(a.url, concurrency=a.concurrency, duration=a.duration, stream=a.stream,
                                max_tokens=a.max_tokens, path=a.path, model=a.model, api_key=a.api_key))
    if a.raw_out:
        with open(a.raw_out, "wb") as f:
            f.write(orjson.dumps({"latencies": r.latencies, "errors": r.errors, "elapsed": r.elapsed,
                                  "first_error": r.first_error}))
        return 0
    print(f"{r.requests} ok, {r.errors} errors in {r.elapsed:.1f} s: {r.requests / r.elapsed:.0f} req/s, "
          f"p50 {r.percentile(50) * 1e3:.2f} ms, p99 {r.percentile(99) * 1e3:.2f} ms")
    if r.first_error:
        print(f"first error: {r.first_error}")
    return 0 if r.requests and not r.errors else 1


if __name__ == "__main__":
    sys.exit(main())
