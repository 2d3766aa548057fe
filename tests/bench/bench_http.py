"""Low-level HTTP benchmark: CPU µs per small request in the server process.

Runs the gateway's HTTP server (h1 keep-alive and h2c) in a child process with a
trivial handler, drives it from this process over loopback, and reads the
child's CPU time from /proc. The same load against a bare asyncio Protocol
that answers every request with a fixed response (no parsing, no tasks) is the
baseline in the same run; the ratio is what to watch.

``--against DIR`` also runs the gateway server of another checkout (say the commit before a
change, from ``git archive REV | tar -x -C DIR``) with this one, alternating, ``--rounds``
times, and prints the best of each and their ratio.

``--inproc`` measures the h1 adapter alone in this process instead: 32 ``H1Protocol``s on
fake transports fed one request each per round, thread CPU time per request (the kernel and
the load generator not counted, so it moves far less with the machine's load), for a
coroutine route through ``task_entrance`` and for a no-task entrance that answers at once.

    .venv/bin/python -m tests.bench.bench_http [--requests 20000] [--conns 8] [--against DIR]
    .venv/bin/python -m tests.bench.bench_http --inproc [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import uvloop

from tests.bench.proc_cpu import cpu_seconds

REQ = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nuser-agent: bench\r\n\r\n"
FIXED = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


async def _serve(kind: str) -> None:
    loop = asyncio.get_running_loop()
    if kind == "raw":

        class Raw(asyncio.Protocol):
            def connection_made(self, t: asyncio.BaseTransport) -> None:
                self.t = t

            def data_received(self, data: bytes) -> None:
                self.t.write(FIXED * data.count(b"\r\n\r\n"))  # type: ignore[attr-defined]

        server = await loop.create_server(Raw, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    else:
        from gateway.http.common import task_entrance
        from gateway.http.server import start_server
        from gateway.http.types import Request, ResponseSink

        async def handler(req: Request, sink: ResponseSink) -> None:
            sink.respond(200, [(b"content-type", b"application/json")], b'{"ok":true}')

        srv = await start_server(task_entrance(handler), host="127.0.0.1", port=0)
        port = srv.port
    print(port, flush=True)
    await asyncio.Event().wait()


class _Client(asyncio.Protocol):
    def __init__(self, n: int, done: asyncio.Future[None]) -> None:
        self.left = n
        self.done = done
        self.buf = b""

    def connection_made(self, t: asyncio.BaseTransport) -> None:
        self.t = t
        t.write(REQ)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        # every response here ends with the same 11-byte body
        got = data.count(b'{"ok":true}')
        self.left -= got
        if self.left <= 0:
            if not self.done.done():
                self.done.set_result(None)
            self.t.close()
        else:
            self.t.write(REQ * got)  # type: ignore[attr-defined]


async def _drive_h1(port: int, total: int, conns: int) -> float:
    loop = asyncio.get_running_loop()
    futs = []
    t0 = time.perf_counter()
    for _ in range(conns):
        fut: asyncio.Future[None] = loop.create_future()
        await loop.create_connection(lambda f=fut: _Client(total // conns, f), "127.0.0.1", port)
        futs.append(fut)
    await asyncio.gather(*futs)
    return time.perf_counter() - t0


class _H2Client(asyncio.Protocol):
    """h2c prior knowledge, ``depth`` streams kept open at a time."""

    def __init__(self, n: int, depth: int, done: asyncio.Future[None]) -> None:
        import h2.config
        import h2.connection

        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.left = self.to_send = n
        self.depth = depth
        self.done = done

    def connection_made(self, t: asyncio.BaseTransport) -> None:
        self.t = t
        self.h2.initiate_connection()
        for _ in range(min(self.depth, self.to_send)):
            self._open()
        t.write(self.h2.data_to_send())  # type: ignore[attr-defined]

    def _open(self) -> None:
        self.to_send -= 1
        sid = self.h2.get_next_available_stream_id()
        hdrs = [(b":method", b"GET"), (b":path", b"/v1/models"), (b":scheme", b"http"), (b":authority", b"x")]
        self.h2.send_headers(sid, hdrs, end_stream=True)

    def data_received(self, data: bytes) -> None:
        import h2.events

        for ev in self.h2.receive_data(data):
            if isinstance(ev, h2.events.DataReceived):
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                self.left -= 1
                if self.to_send > 0:
                    self._open()
        out = self.h2.data_to_send()
        if out:
            self.t.write(out)  # type: ignore[attr-defined]
        if self.left <= 0 and not self.done.done():
            self.done.set_result(None)
            self.t.close()


async def _drive_h2(port: int, total: int, conns: int) -> float:
    loop = asyncio.get_running_loop()
    futs = []
    t0 = time.perf_counter()
    for _ in range(conns):
        fut: asyncio.Future[None] = loop.create_future()
        await loop.create_connection(lambda f=fut: _H2Client(total // conns, 16, f), "127.0.0.1", port)
        futs.append(fut)
    await asyncio.gather(*futs)
    return time.perf_counter() - t0


def _run(kind: str, proto: str, total: int, conns: int, tree: str | None = None) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.bench_http", "--serve", kind],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tree,
        env=env,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        drive = _drive_h1 if proto == "h1" else _drive_h2
        uvloop.run(drive(port, max(conns, total // 10), conns))  # warm up
        cpu0 = cpu_seconds(child.pid)
        wall = uvloop.run(drive(port, total, conns))
        cpu = cpu_seconds(child.pid) - cpu0
    finally:
        child.kill()
        child.wait()
    return cpu / total * 1e6, total / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", choices=["raw", "gateway"])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--against", metavar="DIR", help="another checkout's gateway server, run alternately")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inproc", action="store_true", help="the h1 adapter alone, in this process")
    args = ap.parse_args()
    if args.serve:
        uvloop.run(_serve(args.serve))
        return
    if args.inproc:
        for name, no_task in (("task_entrance", False), ("no-task entrance", True)):
            xs = [uvloop.run(_inproc(no_task)) for _ in range(args.rounds)]
            print(
                f"in-process h1 {name:<17}: {min(xs):6.2f} µs CPU/request (best of {args.rounds})", flush=True
            )
        return
    if args.against:
        _compare(args.against, args.requests, args.conns, args.rounds)
        return
    raw_us, raw_rps = _run("raw", "h1", args.requests, args.conns)
    print(f"baseline raw protocol  h1 : {raw_us:7.1f} µs CPU/request  {raw_rps:9.0f} req/s")
    gw_us, gw_rps = _run("gateway", "h1", args.requests, args.conns)
    print(
        f"gateway http           h1 : {gw_us:7.1f} µs CPU/request  {gw_rps:9.0f} req/s  ratio {gw_us / raw_us:.2f}x"
    )
    n2 = max(args.conns, args.requests // 4)
    h2_us, h2_rps = _run("gateway", "h2", n2, args.conns)
    print(
        f"gateway http           h2c: {h2_us:7.1f} µs CPU/request  {h2_rps:9.0f} req/s  (16 streams/conn, {n2} req)"
    )


class _Sent(asyncio.Transport):
    """Bench double: keeps what the adapter writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []

    def write(self, data: Any) -> None:
        self.out.append(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 5555) if name == "peername" else default

    def is_closing(self) -> bool:
        return False


async def _inproc(no_task: bool, conns: int = 32, rounds: int = 400) -> float:
    """µs of thread CPU per request through H1Protocol (p10 of rounds)."""
    from gateway.http.common import HttpLimits, ServerState, task_entrance
    from gateway.http.h1 import H1Protocol
    from gateway.http.types import Call, Request, ResponseSink

    loop = asyncio.get_running_loop()
    hdrs = [(b"content-type", b"application/json")]

    async def handler(req: Request, sink: ResponseSink) -> None:
        sink.respond(200, hdrs, b'{"ok":true}')

    def answer(req: Request, sink: ResponseSink, done: Callable[[], None]) -> Call:
        sink.respond(200, hdrs, b'{"ok":true}')
        return loop.call_soon(done)

    state = ServerState(answer if no_task else task_entrance(handler), HttpLimits(), None)
    clients = []
    for _ in range(conns):
        proto, t = H1Protocol(state), _Sent()
        proto.connection_made(t)
        clients.append((proto, t))
    per: list[float] = []
    for r in range(rounds + rounds // 10):
        t0 = time.thread_time()
        for proto, _ in clients:
            proto.data_received(REQ)
        for _ in range(3):
            await asyncio.sleep(0)
        cpu = time.thread_time() - t0
        for _, t in clients:
            if len(t.out) != 1 or not t.out[0].endswith(b'{"ok":true}'):
                raise RuntimeError(f"unexpected output {t.out!r}")
            t.out.clear()
        if r >= rounds // 10:
            per.append(cpu / conns * 1e6)
    return statistics.quantiles(per, n=10)[0]  # p10: the rounds least disturbed by other load


def _compare(other: str, total: int, conns: int, rounds: int) -> None:
    n2 = max(conns, total // 4)
    for proto, n in (("h1", total), ("h2", n2)):
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(rounds):
            ours.append(_run("gateway", proto, n, conns)[0])
            theirs.append(_run("gateway", proto, n, conns, other)[0])
        a, b = min(ours), min(theirs)
        print(
            f"{proto:<3} µs CPU/request, best of {rounds}: this tree {a:7.1f}  {other} {b:7.1f}  ratio {a / b:.3f}"
            f"  (all: {' '.join(f'{x:.1f}' for x in ours)} | {' '.join(f'{x:.1f}' for x in theirs)})",
            flush=True,
        )


if __name__ == "__main__":
    main()
