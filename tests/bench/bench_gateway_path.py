"""The gateway's per-request Python path, in one process, without sockets.

``bench_gateway`` measures the real thing (a gateway process under load, CPU
from /proc) but its figure mixes our Python with kernel time and moves with
the machine's load. This benchmark isolates the part we write: the same
objects the gateway runs (``H1Protocol`` -> ``App`` -> ``ModelPool`` ->
``ClientConnection``/``FlowConnection`` and back), on a uvloop loop, with
two bench doubles standing in for the sockets:

* each HTTP client is an ``H1Protocol`` fed the load generator's request
  bytes through a fake transport that keeps what is written;
* the worker is a worker-role ``FlowConnection`` driven here: it takes the
  gateway's Submit frames, then answers as an engine would, one TOKENS frame
  per step (one token for every running request) and a Finish when a request
  has its ``max_tokens``.

Only the gateway side is timed (``time.process_time`` around feeding it bytes
and running its loop callbacks); the worker double's encoding is not counted.
Printed: gateway Python µs per request, non-streaming and 16-token streaming,
for a batch of concurrent requests, and the ratio to ``GET /healthz`` (the
HTTP adapter alone) in the same run.

    .venv/bin/python -m tests.bench.bench_gateway_path [--rounds 300] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import time
from array import array
from typing import Any

import uvloop

from gateway.app import App
from gateway.http.common import HttpLimits, ServerState
from gateway.http.h1 import H1Protocol
from gateway.loadgen import chat_request
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.pool import ModelPool
from gateway.settings import ApiSettings
from transport.client import ClientConnection
from transport.flow import FlowConnection, SubmitReceived
from transport.messages import Finish, FinishReason, Hello, TokenBatch


class _FakeTransport(asyncio.Transport):
    """Bench double: an HTTP client's socket as the gateway sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.out.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for d in list_of_data:
            self.write(d)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: Any = None, low: Any = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


class _WorkerDouble:
    """Bench double: the worker end of the transport, stepping like an engine."""

    def __init__(self) -> None:
        self.core = FlowConnection("worker", Hello(role="worker", identity="bench", models=("tiny",)), 0.0)
        self.running: dict[int, list[int]] = {}  # rid -> [tokens sent, max_tokens]

    def feed(self, data: bytes) -> None:
        for ev in self.core.receive_data(data, 0.0):
            if isinstance(ev, SubmitReceived):
                self.running[ev.submit.request_id] = [0, ev.submit.params.max_tokens]

    def step(self) -> bytes:
        """One engine step: a token for every running request, Finish for those done."""
        rids = array("I", self.running)
        n = len(rids)
        if n:
            self.core.send_tokens(TokenBatch(rids, array("I", [1] * n), array("I", [120] * n),
                                             array("I", [1] * n), b"x" * n))
        for rid in list(rids):
            st = self.running[rid]
            st[0] += 1
            if st[0] >= st[1]:
                del self.running[rid]
                self.core.send_finish(Finish(rid, FinishReason.LENGTH, 11, st[0]))
        return self.core.data_to_send()


class _Sink:
    def __init__(self, worker: _WorkerDouble) -> None:
        self.worker = worker
        self.pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.pending.append(bytes(data))

    def close(self) -> None:
        pass


async def _setup(concurrency: int) -> tuple[App, ClientConnection, _WorkerDouble, _Sink, list[tuple[H1Protocol, _FakeTransport]]]:
    loop = asyncio.get_running_loop()
    worker = _WorkerDouble()
    core = FlowConnection("gateway", Hello(role="gateway", identity="bench", initial_credit=256), loop.time(),
                          heartbeat_interval=3600.0, dead_after=7200.0)
    conn = ClientConnection(core, loop)
    sink = _Sink(worker)
    conn.endpoint.attach(sink)
    worker.core.receive_data(core.data_to_send(), 0.0)  # nothing yet, or our Hello
    await asyncio.sleep(0)
    for chunk in sink.pending:
        worker.feed(chunk)
    sink.pending.clear()
    conn.endpoint.data_received(worker.core.data_to_send())  # the worker's Hello
    await conn._hello
    pool = ModelPool()
    pool.add(conn)
    app = App(pool, GatewayMetrics(), ApiSettings())
    state = ServerState(app.handle, HttpLimits(), None)
    clients = []
    for _ in range(concurrency):
        proto = H1Protocol(state)
        tr = _FakeTransport()
        proto.connection_made(tr)
        clients.append((proto, tr))
    return app, conn, worker, sink, clients


async def _settle(n: int = 4) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _round(req: bytes, conn: ClientConnection, worker: _WorkerDouble, sink: _Sink,
                 clients: list[tuple[H1Protocol, _FakeTransport]], generate: bool) -> float:
    """One batch of concurrent requests; returns gateway CPU seconds spent on it."""
    cpu = 0.0
    t = time.thread_time()
    for proto, _ in clients:
        proto.data_received(req)
    await _settle()
    cpu += time.thread_time() - t
    if generate:
        for chunk in sink.pending:
            worker.feed(chunk)
        sink.pending.clear()
        while worker.running:
            data = worker.step()
            if not data:
                continue  # a step with nothing for the gateway (buffered results): no wake-up there
            t = time.thread_time()
            conn.endpoint.data_received(data)
            await _settle(2)
            cpu += time.thread_time() - t
        t = time.thread_time()
        await _settle()
        cpu += time.thread_time() - t
        for chunk in sink.pending:
            worker.feed(chunk)  # credits and the like
        sink.pending.clear()
    for _, tr in clients:
        if not tr.out:
            raise RuntimeError("a request got no response")
        head = tr.out[0]
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"bad response: {head[:200]!r}")
        tr.out.clear()
    return cpu


async def _scenario(req: bytes, concurrency: int, rounds: int, generate: bool) -> list[float]:
    app, conn, worker, sink, clients = await _setup(concurrency)
    for _ in range(max(3, rounds // 10)):
        await _round(req, conn, worker, sink, clients, generate)
    per_round: list[float] = []
    gc.collect()
    for _ in range(rounds):
        per_round.append(await _round(req, conn, worker, sink, clients, generate) / concurrency * 1e6)
    return per_round


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args(argv)
    from gateway.serve import tune_gc

    tune_gc()
    health = b"GET /healthz HTTP/1.1\r\nhost: b\r\n\r\n"
    chat = chat_request("127.0.0.1", 8080, stream=False, max_tokens=16)
    stream = chat_request("127.0.0.1", 8080, stream=True, max_tokens=16)
    print(f"in-process gateway path, {a.concurrency} concurrent requests x {a.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'scenario':<26}{'µs/req median':>14}{'p10':>8}{'p90':>8}{'x healthz':>10}")
    base = None
    for name, req, gen in (("GET /healthz", health, False), ("chat 16 tok", chat, True),
                           ("chat stream 16 tok", stream, True)):
        xs = uvloop.run(_scenario(req, a.concurrency, a.rounds, gen))
        q = statistics.quantiles(xs, n=10)
        med = statistics.median(xs)
        base = base or med
        print(f"{name:<26}{med:>14.1f}{q[0]:>8.1f}{q[-1]:>8.1f}{med / base:>10.2f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
