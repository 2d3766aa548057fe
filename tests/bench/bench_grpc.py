"""gRPC benchmark: a 256-token Generate stream as native gRPC vs the same completion as SSE/h2.

Each server runs in a child process on loopback with the same token source (one
token per event-loop iteration, no worker): native gRPC is the real grpclib
listener + Inference service (:func:`gateway.grpc.server.start_native`), read by
the grpcio client; the baseline is the gateway's own h2 adapter streaming the
OpenAI chunks the API writes (``ChunkTemplate``), read by httpx over h2c; it
takes its tokens through the same callback bridge (``Generation``) as the gRPC
service, so the two differ only in wire format and protocol stack. From
/proc it takes the child's CPU time and the bytes it wrote to sockets (wchar),
per stream, and prints the ratios to the SSE stream in the same run. The issue's
targets: gRPC CPU <= 1.2x, bytes <= 0.2x.

The same stream as gRPC-Web over the gateway's h2 adapter (the route the HTTP
listeners will get: :func:`gateway.grpc.web_call.serve_web_call`) is measured too.
It also prints the gRPC-Web response body of the same stream (binary, text;
identity, gzip, zstd) against the SSE body, from the sans-I/O writer. Neither
server runs the request pipeline yet (admission, routing, worker), which both
paths will share, so these are the protocol and writer costs alone.

    .venv/bin/python -m tests.bench.bench_grpc [--streams 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOKENS = 256
_TEXT = ("The quick brown fox jumps over the lazy dog while the cat watches from a sunny window "
         "and thinks about nothing in particular, as cats do on long summer afternoons. ").split(" ")
WORDS = [(" " if i else "") + _TEXT[i % len(_TEXT)] for i in range(TOKENS)]


def _proc(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/io") as f:
        wchar = int(next(line for line in f if line.startswith("wchar:")).split()[1])
    return cpu, wchar


class _TokenBackend:
    """The token source for the gRPC server: WORDS, one per loop iteration."""

    def models(self) -> list[str]:
        return ["tiny"]

    def generate(self, spec: object, on_delta: Callable[[str], None], on_end: Callable[[object], None]) -> object:
        from gateway.grpc.backend import Finished
        from transport.messages import FinishReason

        async def play() -> None:
            for w in WORDS:
                await asyncio.sleep(0)
                on_delta(w)
            on_end(Finished(FinishReason.LENGTH, 8, TOKENS))

        return asyncio.get_running_loop().create_task(play())


async def _serve(kind: str) -> None:
    if kind == "grpc":
        from gateway.grpc.server import start_native

        native = await start_native(_TokenBackend(), "127.0.0.1", 0)  # type: ignore[arg-type]
        port = native.port
    elif kind == "grpc-web":
        from gateway.grpc.compression import Codecs
        from gateway.grpc.service import InferenceService
        from gateway.grpc.web_call import serve_web_call
        from gateway.http.server import start_server
        from gateway.http.types import Request, ResponseSink

        handlers = InferenceService(_TokenBackend()).__mapping__()  # type: ignore[arg-type]
        codecs = Codecs()

        class _Sink:  # the WebSink a gRPC-Web route will give serve_web_call
            def __init__(self, sink: ResponseSink) -> None:
                self.sink = sink

            async def start(self, headers: list[tuple[bytes, bytes]]) -> None:
                await self.sink.start(200, headers)

            async def write(self, data: bytes) -> None:
                await self.sink.send(data)

        async def web(req: Request, sink: ResponseSink) -> None:
            async def body() -> AsyncIterator[bytes]:
                yield req.body

            await serve_web_call(handlers, req.path, dict(req.headers), body(), _Sink(sink), codecs, 1 << 20)
            await sink.end()

        port = (await start_server(web, host="127.0.0.1", port=0)).port
    else:
        from gateway.api.render import ChunkTemplate
        from gateway.grpc.backend import GenerateSpec, Generation
        from gateway.http.server import start_server
        from gateway.http.types import Request, ResponseSink

        async def handler(req: Request, sink: ResponseSink) -> None:
            # Tokens reach it the way they reach the gRPC service: the same source, through Generation.
            tpl = ChunkTemplate(True, "chatcmpl-bench0123456789", "tiny", False)
            gen = Generation(_TokenBackend(), GenerateSpec("tiny", prompt="hi"))  # type: ignore[arg-type]
            await sink.start(200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")])
            await sink.send(tpl.role())
            while True:
                text, outcome = await gen.next()
                if text:
                    await sink.send(tpl.content(text))
                if outcome is not None:
                    break
            await sink.send(tpl.finish("length") + b"data: [DONE]\n\n")
            await sink.end()

        port = (await start_server(handler, host="127.0.0.1", port=0)).port
    print(port, flush=True)
    await asyncio.Event().wait()


def _drive_grpc(port: int, streams: int) -> None:
    import grpc

    from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_stream("/quicserve.v1.Inference/Generate", request_serializer=pb.GenerateRequest.SerializeToString,
                               response_deserializer=pb.GenerateResponse.FromString)
        for _ in range(streams):
            text = "".join(r.text for r in call(pb.GenerateRequest(model="tiny", prompt="hi")))
            assert text == "".join(WORDS)


def _drive_grpc_web(port: int, streams: int) -> None:
    import httpx

    from gateway.grpc.framing import encode_frame
    from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
    body = encode_frame(0, pb.GenerateRequest(model="tiny", prompt="hi").SerializeToString())
    with httpx.Client(http1=False, http2=True) as client:
        for _ in range(streams):
            r = client.post(f"http://127.0.0.1:{port}/quicserve.v1.Inference/Generate", content=body,
                            headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1"})
            assert r.content.endswith(b"grpc-status:0\r\n"), r.content[-40:]


def _drive_sse(port: int, streams: int) -> None:
    import httpx
    with httpx.Client(http1=False, http2=True) as client:
        for _ in range(streams):
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", content=b"{}") as r:
                assert r.http_version == "HTTP/2"
                for _ in r.iter_bytes():
                    pass


def _measure(kind: str, streams: int) -> tuple[float, float]:
    child = subprocess.Popen([sys.executable, "-m", "tests.bench.bench_grpc", "--serve", kind],
                             stdout=subprocess.PIPE, cwd=REPO, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        drive = {"grpc": _drive_grpc, "grpc-web": _drive_grpc_web, "sse": _drive_sse}[kind]
        drive(port, max(5, streams // 10))  # warm up: imports, connection, caches
        cpu0, bytes0 = _proc(child.pid)
        drive(port, streams)
        cpu1, bytes1 = _proc(child.pid)
        return (cpu1 - cpu0) / streams, (bytes1 - bytes0) / streams
    finally:
        child.kill()
        child.wait()


def _web_bodies() -> None:
    from gateway.api.render import ChunkTemplate
    from gateway.grpc.backend import Finished
    from gateway.grpc.compression import GzipCodec, ZstdCodec
    from gateway.grpc.convert import reason_of, usage_of
    from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
    from gateway.grpc.status import Status
    from gateway.grpc.web import WebResponseWriter
    from transport.messages import FinishReason

    tpl = ChunkTemplate(True, "chatcmpl-bench0123456789", "tiny", False)
    sse = len(tpl.role() + b"".join(tpl.content(w) for w in WORDS) + tpl.finish("length") + b"data: [DONE]\n\n")
    fin = Finished(FinishReason.LENGTH, 8, TOKENS)
    msgs = [pb.GenerateResponse(text=w).SerializeToString() for w in WORDS[:-1]]
    msgs.append(pb.GenerateResponse(text=WORDS[-1], finish_reason=reason_of(fin), usage=usage_of(fin)).SerializeToString())
    print(f"\ngRPC-Web body of the same stream vs the SSE body ({sse} bytes), one message per token:")
    for text in (False, True):
        for codec in (None, GzipCodec(), ZstdCodec()):
            w = WebResponseWriter(text=text, codec=codec, accept_encoding="")
            n = sum(len(w.message(m)) for m in msgs) + len(w.trailers(Status.OK))
            name = ("text " if text else "binary ") + (codec.name if codec else "identity")
            print(f"  {name:16s} {n:7d} bytes  {n / sse:5.3f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--serve", choices=["grpc", "grpc-web", "sse"])
    args = ap.parse_args(argv)
    if args.serve:
        import uvloop
        uvloop.run(_serve(args.serve))
        return 0
    t0 = time.perf_counter()
    sse_cpu, sse_bytes = _measure("sse", args.streams)
    print(f"{TOKENS}-token stream, {args.streams} streams each, server process per stream:")
    print(f"  SSE over h2c                     {sse_cpu * 1e6:6.0f} us CPU  {sse_bytes:6.0f} bytes written")
    for kind, name in (("grpc", "native gRPC (grpclib)"), ("grpc-web", "gRPC-Web over h2c (our h2)")):
        cpu, wrote = _measure(kind, args.streams)
        print(f"  {name:32s} {cpu * 1e6:6.0f} us CPU  {wrote:6.0f} bytes written   "
              f"{cpu / sse_cpu:4.2f}x CPU (target <= 1.2)  {wrote / sse_bytes:5.3f}x bytes (target <= 0.2)")
    _web_bodies()
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
