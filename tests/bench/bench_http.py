"""Low-level HTTP benchmark: CPU µs per small request in the server process.

Runs the gateway's HTTP server (h1 keep-alive and h2c) in a child process with a
trivial handler, drives it from this process over loopback, and reads the
child's CPU time from /proc. The same load against a bare asyncio Protocol
that answers every request with a fixed response (no parsing, no tasks) is the
baseline in the same run; the ratio is what to watch.

    .venv/bin/python -m tests.bench.bench_http [--requests 20000] [--conns 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import uvloop

REQ = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nuser-agent: bench\r\n\r\n"
FIXED = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        from gateway.http.server import start_server
        from gateway.http.types import Request, ResponseSink

        async def handler(req: Request, sink: ResponseSink) -> None:
            await sink.respond(200, [(b"content-type", b"application/json")], b'{"ok":true}')

        srv = await start_server(handler, host="127.0.0.1", port=0)
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


def _run(kind: str, proto: str, total: int, conns: int) -> tuple[float, float]:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.bench_http", "--serve", kind],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        drive = _drive_h1 if proto == "h1" else _drive_h2
        uvloop.run(drive(port, max(conns, total // 10), conns))  # warm up
        cpu0 = _cpu_seconds(child.pid)
        wall = uvloop.run(drive(port, total, conns))
        cpu = _cpu_seconds(child.pid) - cpu0
    finally:
        child.kill()
        child.wait()
    return cpu / total * 1e6, total / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", choices=["raw", "gateway"])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--conns", type=int, default=8)
    args = ap.parse_args()
    if args.serve:
        uvloop.run(_serve(args.serve))
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


if __name__ == "__main__":
    main()
