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

Against another checkout (the commit before a change that must keep the speed), in one
alternating run: ``--baseline DIR`` runs this same driver twice as child processes, one
importing the gateway from DIR and one from this tree, and alternates blocks of ``--block``
rounds between them (which side goes first alternates too) until each has ``--rounds`` per
scenario. Printed per scenario: each side's median, p10 and best round, the ratios this/baseline,
the paired ratio (the median over blocks of this block's median / the baseline's block median:
what the machine's changing load shifts least) and the verdict on it against ``--limit`` (+5%:
the one-pipeline rework's bar)::

    .venv/bin/python -m tests.bench.bench_gateway_path --baseline /work/base --rounds 400
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
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

try:
    from transport.hold import ResultHold  # whole results held above the flow core
except ImportError:  # a tree where the flow core held them itself (--baseline)
    ResultHold = None  # type: ignore[assignment,misc]


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
        # as the worker's ServerConnectionImpl: sends through the hold, which sees the core's events first
        self.send: Any = ResultHold(self.core) if ResultHold is not None else self.core
        self.running: dict[int, list[int]] = {}  # rid -> [tokens sent, max_tokens]

    def feed(self, data: bytes) -> None:
        events = self.core.receive_data(data, 0.0)
        if ResultHold is not None:
            self.send.observe(events)
        for ev in events:
            if isinstance(ev, SubmitReceived):
                self.running[ev.submit.request_id] = [0, ev.submit.params.max_tokens]

    def step(self) -> bytes:
        """One engine step: a token for every running request, Finish for those done."""
        rids = array("I", self.running)
        n = len(rids)
        if n:
            self.send.send_tokens(TokenBatch(rids, array("I", [1] * n), array("I", [120] * n),
                                             array("I", [1] * n), b"x" * n))
        for rid in list(rids):
            st = self.running[rid]
            st[0] += 1
            if st[0] >= st[1]:
                del self.running[rid]
                self.send.send_finish(Finish(rid, FinishReason.LENGTH, 11, st[0]))
        if ResultHold is not None:
            self.send.flush()
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
    entrance: Any = vars(App).get("handle")  # App.handle; a tree before the one entrance takes the app
    return app, conn, worker, sink, _clients(app.handle if entrance is not None else app, concurrency)


def _clients(entrance: Any, concurrency: int) -> list[tuple[H1Protocol, _FakeTransport]]:
    """``concurrency`` HTTP/1.1 connections into ``entrance``, each on a fake transport."""
    state = ServerState(entrance, HttpLimits(), None)
    clients = []
    for _ in range(concurrency):
        proto = H1Protocol(state)
        tr = _FakeTransport()
        proto.connection_made(tr)
        clients.append((proto, tr))
    return clients


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


def _requests() -> list[tuple[str, bytes, bool]]:
    return [("GET /healthz", b"GET /healthz HTTP/1.1\r\nhost: b\r\n\r\n", False),
            ("chat 16 tok", chat_request("127.0.0.1", 8080, stream=False, max_tokens=16), True),
            ("chat stream 16 tok", chat_request("127.0.0.1", 8080, stream=True, max_tokens=16), True)]


async def _serve(concurrency: int) -> None:
    """Child of ``--baseline``: every scenario set up once; each stdin line "SCENARIO N" runs N
    rounds of it and answers one JSON line of µs per request (a first "warm N" warms them all)."""
    reqs = _requests()
    setups = [await _setup(concurrency) for _ in reqs]
    for line in sys.stdin:
        what, n = line.split()
        if what == "warm":
            for (_, req, gen), (_, conn, worker, sink, clients) in zip(reqs, setups, strict=True):
                for _ in range(int(n)):
                    await _round(req, conn, worker, sink, clients, gen)
            gc.collect()
            print("[]", flush=True)
            continue
        (_, req, gen), (_, conn, worker, sink, clients) = reqs[int(what)], setups[int(what)]
        xs = [await _round(req, conn, worker, sink, clients, gen) / concurrency * 1e6 for _ in range(int(n))]
        print(json.dumps(xs), flush=True)


def _compare(baseline: str, rounds: int, concurrency: int, block: int, limit: float) -> int:
    """Alternate this tree and ``baseline`` in one run (see the module docstring)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trees = {"baseline": os.path.abspath(baseline), "this": here}
    procs = {name: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--concurrency",
                                     str(concurrency)], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name, tree in trees.items()}

    def ask(name: str, cmd: str) -> list[float]:
        p = procs[name]
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(cmd + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"the {name} side ({trees[name]}) stopped")
        return [float(x) for x in json.loads(line)]

    names = list(trees)
    reqs = _requests()
    print(f"in-process gateway path, this tree against {trees['baseline']}: {concurrency} concurrent requests, "
          f"{rounds} rounds per scenario and side in alternating blocks of {block}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        for name in names:
            ask(name, f"warm {max(3, rounds // 10)}")
        got: dict[str, list[list[float]]] = {name: [[] for _ in reqs] for name in names}
        paired: list[list[float]] = [[] for _ in reqs]  # per block: this median / baseline median
        for b in range(-(-rounds // block)):
            n = min(block, rounds - b * block)
            for i in range(len(reqs)):
                med = {}
                for name in names if b % 2 == 0 else names[::-1]:
                    xs = ask(name, f"{i} {n}")
                    got[name][i] += xs
                    med[name] = statistics.median(xs)
                paired[i].append(med["this"] / med["baseline"])
    finally:
        for p in procs.values():
            if p.stdin is not None:
                p.stdin.close()
            p.wait(30)
    print(f"{'scenario':<22}{'base med':>9}{'this med':>9}{'ratio':>7}{'base p10':>9}{'this p10':>9}{'ratio':>7}"
          f"{'base best':>10}{'this best':>10}{'ratio':>7}{'paired':>8}   µs/request")
    worst = 0.0
    for i, (scen, _, gen) in enumerate(reqs):
        b, t = got["baseline"][i], got["this"][i]
        bm, tm, bb, tb = statistics.median(b), statistics.median(t), min(b), min(t)
        bp, tp = statistics.quantiles(b, n=10)[0], statistics.quantiles(t, n=10)[0]
        pr = statistics.median(paired[i])
        verdict = ""
        if gen:
            worst = max(worst, pr)
            verdict = "  ok" if pr <= 1 + limit else f"  OVER +{limit:.0%}"
        print(f"{scen:<22}{bm:>9.1f}{tm:>9.1f}{tm / bm:>7.3f}{bp:>9.1f}{tp:>9.1f}{tp / bp:>7.3f}"
              f"{bb:>10.1f}{tb:>10.1f}{tb / bb:>7.3f}{pr:>8.3f}{verdict}")
    print(f"generation requests: this/baseline at most {worst:.3f} (paired: the median over blocks of the ratio of "
          f"the two sides' block medians, which the machine's changing load affects least): "
          f"{'within' if worst <= 1 + limit else 'beyond'} +{limit:.0%}; load average after {os.getloadavg()[0]:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--baseline", metavar="DIR", help="another checkout to compare against, alternating")
    ap.add_argument("--block", type=int, default=20, help="rounds per turn with --baseline")
    ap.add_argument("--limit", type=float, default=0.05, help="allowed slowdown with --baseline")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a --baseline child
    a = ap.parse_args(argv)
    if a.baseline:
        return _compare(a.baseline, a.rounds, a.concurrency, a.block, a.limit)
    from gateway.serve import tune_gc

    tune_gc()
    if a.serve:
        uvloop.run(_serve(a.concurrency))
        return 0
    print(f"in-process gateway path, {a.concurrency} concurrent requests x {a.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'scenario':<26}{'µs/req median':>14}{'p10':>8}{'p90':>8}{'x healthz':>10}")
    base = None
    for name, req, gen in _requests():
        xs = uvloop.run(_scenario(req, a.concurrency, a.rounds, gen))
        q = statistics.quantiles(xs, n=10)
        med = statistics.median(xs)
        base = base or med
        print(f"{name:<26}{med:>14.1f}{q[0]:>8.1f}{q[-1]:>8.1f}{med / base:>10.2f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
