"""gRPC through the real gateway: a 256-token Generate stream as native gRPC and gRPC-Web (identity,
gzip, zstd) against the same completion as SSE over HTTP/2, in one alternating run.

It starts ``quicserve serve --engine synthetic --grpc-port 0`` (the gateway process and its
synthetic worker child), so every stream goes through the whole pipeline: the listener, admission,
parsing, routing, the transport to the worker, the generation call and the protocol's writer. The
synthetic engine never samples its EOS token, so ``max_tokens=256`` gives exactly 256 tokens (one
byte each, printable ASCII); every variant asks for the same prompt and seed and must get the same
text (checked on every stream). The variants:

* ``sse``       ``POST /v1/completions`` ``stream=true`` over h2c (httpx, prior knowledge): the baseline;
* ``grpc``      native gRPC ``quicserve.v1.Inference/Generate``, the grpcio client (asyncio API), the
  channel limited to identity (its ``grpc-accept-encoding`` is ``identity``);
* ``grpc-gzip`` the same with ``grpc.Compression.Gzip`` (``identity, gzip`` accepted; grpcio sends a
  message this small uncompressed, flag 0): the server's choice decides the responses, and the label
  says what it chose (``->identity``, ``->gzip``);
* ``web``, ``web-gzip``, ``web-zstd``: gRPC-Web (``application/grpc-web+proto``) over h2c (httpx) on
  the HTTP listener, ``grpc-accept-encoding`` identity, gzip or zstd.

The engine takes ``--step-ms`` (2) per step, as a model would, and ``--concurrency`` (16) streams
of a variant are in flight at once, so each engine step gives each stream one token and the gateway
wakes for a batch of streams, as under load. (``--step-ms 0`` runs the engine flat out: tokens then
pile up between the gateway's wake-ups, and the gRPC writers send what accumulated in one message
where SSE still sends an event per step, so message counts, bytes and CPU depend on timing.)

Each round runs ``--streams`` streams of every variant (one connection per variant, the order
rotated each round) and reads, before and after, from /proc:

* the gateway process's CPU time (utime + stime of /proc/PID/stat, all its threads; not the worker,
  not the clients), per stream;
* bytes on the wire per stream, counted at the client side: every client connects through a
  counting TCP relay (:mod:`tests.bench.wire_relay`, in the harness process), which counts the TCP
  payload the gateway sent (every HTTP/2 frame: HEADERS, DATA with gRPC framing, trailers,
  SETTINGS, PING, WINDOW_UPDATE; not TCP/IP headers). The gateway's ``wchar`` (/proc/PID/io: all
  its writes, the worker's socket included) is printed beside it as a cross-check, and ``syscw``,
  its write calls per stream (how well a protocol's writes are coalesced).

The table gives each variant's best and median round, the ratios to SSE's (best to best, median to
median) and the issue's verdicts: native gRPC CPU <= 1.2x SSE/h2 (best to best), bytes <= 0.2x SSE
(``--strict``: exit 1 when one is missed). Compression must never make a message larger: every
gRPC-Web response frame is parsed, and a frame flagged compressed (1) must be shorter than the
identity message it inflates to (else the run stops); frames sent uncompressed under a codec are
counted, with those the codec (same level) would have shrunk. grpcio hides its frames, so before the
rounds a raw h2 probe calls the native port once per encoding (``grpc-accept-encoding`` X, and a
request compressed with X) and prints the status and the frames; an encoding the server refuses
prints "unsupported" with its status (a timed variant whose calls are refused is skipped the same
way). The probe also calls ``Complete`` (the whole completion in one message) native and gRPC-Web.
The synthetic engine's text is uniformly random printable ASCII (about 6.6 bits a byte), so no codec
shrinks its messages, not even the 256-byte ``Complete`` reply: the rule is then seen at work as
"0 flagged, 0 would shrink"; the flag-1 branch is what tests/gateway/grpc/test_compression.py covers.

The gateway runs pinned to the first CPU, the harness (clients, relay) and the worker to the others,
as in ``bench_gateway``. Messages per stream are printed too.

    PYTHONPATH=$PWD .venv/bin/python -m tests.bench.bench_grpc [--streams 200] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import h2.config  # noqa: E402
import h2.connection  # noqa: E402
import h2.events  # noqa: E402
import httpx  # noqa: E402
import orjson  # noqa: E402

from gateway.grpc.compression import Codec, GzipCodec, ZstdCodec  # noqa: E402
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb  # noqa: E402
from tests.bench.proc_cpu import cpu_seconds  # noqa: E402
from tests.bench.wire_relay import CountingRelay  # noqa: E402

TOKENS = 256
PROMPT = "hi"
SEED = 1
MODEL = "tiny"
METHOD = "/quicserve.v1.Inference/Generate"
COMPLETE = "/quicserve.v1.Inference/Complete"  # the whole completion in one message: one that can shrink
TARGET_CPU = 1.2
TARGET_BYTES = 0.2
LIMIT = 1 << 22
# The client's codecs, at the levels the gateway uses by default ([grpc] gzip_level, zstd_level).
CODECS: dict[str, Codec] = {"gzip": GzipCodec(), "zstd": ZstdCodec()}


def proc_cpu_io(pid: int) -> tuple[float, int, int]:
    """CPU seconds (:func:`~tests.bench.proc_cpu.cpu_seconds`), wchar (bytes written) and syscw (write
    calls) of one process, not its children."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return cpu_seconds(pid), int(io["wchar"]), int(io["syscw"])


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# --- the gateway -------------------------------------------------------------------------------


@dataclass
class Gateway:
    proc: subprocess.Popen[str]
    http: tuple[str, int]
    grpc: tuple[str, int]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    return host.strip("[]"), int(port)


def start_gateway(state: str, log: Path, step_ms: float) -> Gateway:
    """``quicserve serve`` with the synthetic worker, HTTP (h1/h2c) and native gRPC on free ports."""
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--port", "0", "--no-tls",
           "--grpc-port", "0", "--progress", "off", "--log-level", "warning", "--state-dir", state,
           f"--worker-option=synthetic_step_ms={step_ms:g}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0"}
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"gateway exited with {proc.wait()}: {log.read_text()[-2000:]}")
        urls += re.findall(r"listening on (\S+)", line)
        if line.startswith("quicserve: ready"):
            http = next(u for u in urls if u.startswith("http://"))
            native = next(u for u in urls if u.startswith("grpc://"))
            return Gateway(proc, _hostport(http), _hostport(native))
    proc.kill()
    raise RuntimeError("gateway not ready in 120 s")


# --- clients: one stream each, checked; they return messages (SSE events, gRPC messages) ------------


class StreamError(Exception):
    pass


def _request() -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, prompt=PROMPT, sampling=pb.Sampling(max_tokens=TOKENS, seed=SEED))


def _frame(flags: int, payload: bytes) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def _frames(raw: bytes) -> list[tuple[int, bytes]]:
    out, pos = [], 0
    while pos < len(raw):
        if len(raw) - pos < 5:
            raise StreamError(f"truncated frame header at {pos}")
        flags, n = struct.unpack_from(">BI", raw, pos)
        if len(raw) - pos - 5 < n:
            raise StreamError(f"truncated frame at {pos}")
        out.append((flags, raw[pos + 5:pos + 5 + n]))
        pos += 5 + n
    return out


@dataclass
class FrameCheck:
    """What the compressed variants sent: frames flagged compressed, and those sent plain."""

    compressed: int = 0
    plain: int = 0
    plain_would_shrink: int = 0
    saved: int = 0  # identity bytes minus compressed bytes over the flagged frames


def check_messages(frames: list[tuple[int, bytes]], encoding: str | None, check: FrameCheck) -> list[bytes]:
    """The identity messages of a response's message frames; a compressed frame must be smaller."""
    codec = CODECS.get(encoding or "")
    out: list[bytes] = []
    for flags, payload in frames:
        if flags & 1:
            if codec is None:
                raise StreamError("a frame flagged compressed without a grpc-encoding")
            message = codec.decompress(payload, LIMIT)
            if len(payload) >= len(message):
                raise StreamError(f"COMPRESSION MADE A MESSAGE LARGER: {len(message)} -> {len(payload)} bytes "
                                  f"({encoding}, flag 1)")
            check.compressed += 1
            check.saved += len(message) - len(payload)
        else:
            message = payload
            if codec is not None:
                check.plain += 1
                check.plain_would_shrink += len(codec.compress(message)) < len(message)
        out.append(message)
    return out


def check_generate(messages: list[pb.GenerateResponse], expected: str) -> None:
    text = "".join(m.text for m in messages)
    last = messages[-1] if messages else pb.GenerateResponse()
    if text != expected or last.finish_reason != pb.FINISH_REASON_LENGTH or last.usage.completion_tokens != TOKENS:
        raise StreamError(f"unexpected stream: {len(text)} chars, finish {last.finish_reason}, "
                          f"usage {last.usage.completion_tokens}: {text[:40]!r}...")


async def sse_stream(client: httpx.AsyncClient, base: str, expected: str | None) -> tuple[int, str]:
    body = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "seed": SEED, "stream": True})
    parts = []
    async with client.stream("POST", base + "/v1/completions", content=body,
                             headers={"content-type": "application/json"}) as r:
        if r.status_code != 200 or r.http_version != "HTTP/2":
            raise StreamError(f"SSE: {r.http_version} {r.status_code}: {(await r.aread())[:200]!r}")
        async for chunk in r.aiter_raw():
            parts.append(chunk)
    events = [e for e in b"".join(parts).split(b"\n\n") if e]
    if events[-1] != b"data: [DONE]":
        raise StreamError(f"SSE: no [DONE]: {events[-1][:200]!r}")
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    if chunks[-1]["choices"][0]["finish_reason"] != "length" or len(text) != TOKENS or (expected and text != expected):
        raise StreamError(f"SSE: unexpected stream: {len(text)} chars, {chunks[-1]}")
    return len(events), text


async def web_stream(client: httpx.AsyncClient, base: str, encoding: str, expected: str,
                     check: FrameCheck, method: str = METHOD) -> int:
    headers = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1", "grpc-accept-encoding": encoding}
    parts = []
    async with client.stream("POST", base + method, content=_frame(0, _request().SerializeToString()),
                             headers=headers) as r:
        async for chunk in r.aiter_raw():
            parts.append(chunk)
        if r.status_code != 200 or r.http_version != "HTTP/2":
            raise StreamError(f"gRPC-Web: {r.http_version} {r.status_code}")
        got = r.headers.get("grpc-encoding")
    frames = _frames(b"".join(parts))
    if not frames or not frames[-1][0] & 0x80:
        raise StreamError("gRPC-Web: no trailer frame")
    trailers = dict(line.split(":", 1) for line in frames[-1][1].decode().split("\r\n") if line)
    if trailers.get("grpc-status") != "0":
        raise StreamError(f"gRPC-Web: grpc-status {trailers}")
    if got not in (None, "identity") and got != encoding:
        raise StreamError(f"gRPC-Web: asked for {encoding}, got grpc-encoding {got}")
    messages = check_messages(frames[:-1], got, check)
    check_generate([pb.GenerateResponse.FromString(m) for m in messages], expected)
    return len(messages)


async def grpc_stream(channel: grpc.aio.Channel, expected: str) -> int:
    call = channel.unary_stream(METHOD, request_serializer=pb.GenerateRequest.SerializeToString,
                                response_deserializer=pb.GenerateResponse.FromString)
    messages = [m async for m in call(_request(), timeout=60)]
    check_generate(messages, expected)
    return len(messages)


# --- native gRPC, frame by frame: a raw h2 probe --------------------------------------------------


@dataclass
class Probe:
    status: str
    message: str
    encoding: str  # the response's grpc-encoding
    frames: list[tuple[int, bytes]] = field(default_factory=list)


def probe_native(addr: tuple[str, int], accept: str, request_encoding: str | None, method: str = METHOD) -> Probe:
    """One Generate over a raw h2 connection: ``grpc-accept-encoding: accept``, the request message
    compressed with ``request_encoding`` (flag 1) when given; what the server answered, frame by frame."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="latin-1"))
    conn.initiate_connection()
    message = _request().SerializeToString()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", f"{addr[0]}:{addr[1]}"),
               ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-accept-encoding", accept)]
    if request_encoding:
        headers.append(("grpc-encoding", request_encoding))
        body = _frame(1, CODECS[request_encoding].compress(message))
    else:
        body = _frame(0, message)
    conn.send_headers(1, headers)
    conn.send_data(1, body, end_stream=True)
    got: dict[str, str] = {}
    data = bytearray()
    with socket.create_connection(addr, timeout=30) as sock:
        sock.sendall(conn.data_to_send())
        done = False
        while not done:
            chunk = sock.recv(65536)
            if not chunk:
                break
            for ev in conn.receive_data(chunk):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    got.update(ev.headers)  # type: ignore[arg-type]
                elif isinstance(ev, h2.events.DataReceived):
                    data += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamReset):
                    got.setdefault("grpc-status", f"RST_STREAM {ev.error_code!r}")
                    done = True
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.ConnectionTerminated)):
                    done = True
            sock.sendall(conn.data_to_send())
    status = got.get("grpc-status", "none")
    name = {str(c.value[0]): c.name for c in grpc.StatusCode}.get(status, "")
    return Probe(f"{status} {name}", got.get("grpc-message", ""), got.get("grpc-encoding", "identity"),
                 _frames(bytes(data)) if data else [])


def run_probes(addr: tuple[str, int], expected: str) -> dict[str, str]:
    """Each encoding against native gRPC, printed; returns the response's grpc-encoding per accepted one."""
    print("native gRPC, frame by frame (raw h2 probe, one call each):")
    answered: dict[str, str] = {}
    calls = [("identity", None, METHOD), ("gzip", None, METHOD), ("gzip", "gzip", METHOD), ("zstd", None, METHOD),
             ("zstd", "zstd", METHOD), ("gzip", None, COMPLETE), ("zstd", None, COMPLETE)]
    with ThreadPoolExecutor(len(calls)) as pool:  # at once: each takes 256 engine steps
        probes = list(pool.map(lambda c: probe_native(addr, c[0], c[1], c[2]), calls))
    for (enc, req_enc, method), p in zip(calls, probes, strict=True):
        what = (f"  {method.rsplit('/', 1)[1]:8s} accept {enc:8s} "
                f"request {'compressed ' + req_enc if req_enc else 'identity':18s}")
        if not p.status.startswith("0 "):
            print(f"{what} unsupported: grpc-status {p.status} {p.message!r}")
            continue
        check = FrameCheck()
        try:
            msgs = check_messages(p.frames, p.encoding, check)
            check_generate([pb.GenerateResponse.FromString(m) for m in msgs], expected)
        except StreamError as e:
            print(f"{what} FAILED: {e}")
            raise
        note = (f"flag 1: {check.compressed}, flag 0: {check.plain} ({check.plain_would_shrink} would shrink)"
                if p.encoding != "identity" else "")
        print(f"{what} OK, response grpc-encoding {p.encoding}, {len(msgs)} messages {note}")
        if req_enc is None and method == METHOD:
            answered[enc] = p.encoding
    return answered


# --- the rounds --------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    label: str
    run_one: Callable[[], Awaitable[int]]  # one stream; returns its message count
    relay: CountingRelay
    check: FrameCheck | None = None
    skip: str = ""
    cpu: list[float] = field(default_factory=list)  # µs per stream, per round
    wire: list[float] = field(default_factory=list)  # bytes per stream, per round
    wchar: list[float] = field(default_factory=list)
    syscw: list[float] = field(default_factory=list)
    msgs: list[float] = field(default_factory=list)


async def measure(v: Variant, gw_pid: int, streams: int, concurrency: int) -> None:
    counts: list[int] = []
    todo = iter(range(streams))

    async def worker() -> None:
        for _ in todo:
            counts.append(await v.run_one())

    cpu0, w0, sc0 = proc_cpu_io(gw_pid)
    d0 = v.relay.down
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu1, w1, sc1 = proc_cpu_io(gw_pid)
    v.syscw.append((sc1 - sc0) / streams)
    v.cpu.append((cpu1 - cpu0) / streams * 1e6)
    v.wire.append((v.relay.down - d0) / streams)
    v.wchar.append((w1 - w0) / streams)
    v.msgs.append(sum(counts) / streams)


def _fmt_ratio(x: float, target: float) -> str:
    return f"{x:5.2f}x {'MET' if x <= target else 'MISSED'}"


async def bench(a: argparse.Namespace, gw: Gateway) -> int:
    http = await CountingRelay.start(gw.http)
    native = await CountingRelay.start(gw.grpc)
    base = f"http://127.0.0.1:{http.port}"
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    clients = [httpx.AsyncClient(http1=False, http2=True, timeout=60, limits=limits) for _ in range(4)]
    target = f"127.0.0.1:{native.port}"
    ch_identity = grpc.aio.insecure_channel(target, options=[("grpc.compression_enabled_algorithms_bitset", 1)])
    ch_gzip = grpc.aio.insecure_channel(target, options=[("grpc.compression_enabled_algorithms_bitset", 1 | 4)],
                                        compression=grpc.Compression.Gzip)
    try:
        _, expected = await sse_stream(clients[0], base, None)
        web_checks = {enc: FrameCheck() for enc in ("gzip", "zstd")}
        answered, _ = await asyncio.gather(
            asyncio.to_thread(run_probes, gw.grpc, expected),
            asyncio.gather(*(web_stream(clients[0], base, enc, expected, c, COMPLETE) for enc, c in web_checks.items())))
        print("gRPC-Web Complete (the whole completion in one message), frame by frame:")
        for enc, check in web_checks.items():
            print(f"  Complete accept {enc:8s} OK: flag 1: {check.compressed} ({check.saved} bytes saved), "
                  f"flag 0: {check.plain} ({check.plain_would_shrink} would shrink)")

        async def sse() -> int:
            return (await sse_stream(clients[0], base, expected))[0]

        def web(client: httpx.AsyncClient, enc: str, check: FrameCheck) -> Callable[[], Awaitable[int]]:
            return lambda: web_stream(client, base, enc, expected, check)

        checks = {enc: FrameCheck() for enc in ("identity", "gzip", "zstd")}
        variants = [
            Variant("sse", "SSE /v1/completions, h2c", sse, http),
            Variant("grpc", "native gRPC identity", lambda: grpc_stream(ch_identity, expected), native),
            Variant("grpc-gzip", f"native gRPC gzip ->{answered.get('gzip', '?')}",
                    lambda: grpc_stream(ch_gzip, expected), native),
        ] + [Variant(f"web{'' if enc == 'identity' else '-' + enc}", f"gRPC-Web {enc}, h2c",
                     web(clients[i + 1], enc, checks[enc]), http, checks[enc]) for i, enc in enumerate(checks)]
        async def warm(v: Variant) -> None:  # imports, connections, caches; a refusal marks the variant skipped
            try:
                await asyncio.gather(*(v.run_one() for _ in range(a.warmup or a.concurrency)))
            except grpc.aio.AioRpcError as e:
                v.skip = f"unsupported: {e.code().name} {e.details()!r}"
            except StreamError as e:
                v.skip = f"FAILED: {e}"

        await asyncio.gather(*(warm(v) for v in variants))
        live = [v for v in variants if not v.skip]
        for v in variants:
            if v.skip:
                print(f"  {v.label}: {v.skip}")
        print(f"{a.rounds} rounds x {a.streams} streams per variant, {a.concurrency} at a time; "
              f"order rotated each round; load average {_load()}")
        for r in range(a.rounds):
            order = live[r % len(live):] + live[:r % len(live)]
            for v in order:
                await measure(v, gw.proc.pid, a.streams, a.concurrency)
                if gw.proc.poll() is not None:
                    raise RuntimeError(f"the gateway exited with {gw.proc.returncode}")
            print(f"  round {r + 1}: " + "  ".join(f"{v.name} {v.cpu[-1]:.0f}µs/{v.wire[-1]:.0f}B" for v in live),
                  flush=True)
        missed = report(variants, a.rounds)
        failed = any(v.skip.startswith("FAILED") for v in variants)
        return 1 if failed or (a.strict and missed) else 0
    finally:
        for c in clients:
            await c.aclose()
        await ch_identity.close()
        await ch_gzip.close()
        http.close()
        native.close()


def report(variants: list[Variant], rounds: int) -> bool:
    """Print the table; True when a target was missed."""
    sse = variants[0]
    s_best, s_med = min(sse.cpu), statistics.median(sse.cpu)
    s_wire = statistics.median(sse.wire)
    print(f"\ngateway CPU µs per stream (best / median of {rounds}); per stream, medians: bytes (wire: what the "
          f"gateway sent on the client connection; wchar: all its writes), its write calls (syscw), messages")
    missed = False
    print(f"{'variant':<30}{'CPU best':>9}{'median':>8}{'x SSE':>7}{'(med)':>7}{'wire B':>9}{'x SSE':>8}"
          f"{'wchar B':>9}{'writes':>7}{'msgs':>6}  verdicts")
    for v in variants:
        if v.skip:
            print(f"{v.label:<30}  {v.skip}")
            continue
        best, med, wire = min(v.cpu), statistics.median(v.cpu), statistics.median(v.wire)
        verdicts = ""
        if v is not sse:
            if v.name.startswith("grpc"):
                verdicts += f"CPU {_fmt_ratio(best / s_best, TARGET_CPU)} (<= {TARGET_CPU})  "
                missed |= best / s_best > TARGET_CPU
            verdicts += f"bytes {_fmt_ratio(wire / s_wire, TARGET_BYTES)} (<= {TARGET_BYTES})"
            missed |= wire / s_wire > TARGET_BYTES
        print(f"{v.label:<30}{best:>9.0f}{med:>8.0f}{best / s_best:>7.2f}{med / s_med:>7.2f}{wire:>9.0f}"
              f"{wire / s_wire:>8.3f}{statistics.median(v.wchar):>9.0f}{statistics.median(v.syscw):>7.0f}"
              f"{statistics.median(v.msgs):>6.0f}  {verdicts}")
    print("\ncompression never makes a message larger (gRPC-Web, every response frame of every stream):")
    for v in variants:
        c = v.check
        if c is None or v.skip or v.name == "web":
            continue
        print(f"  {v.label:<28} OK: {c.compressed} frames flagged compressed, each smaller than its message "
              f"({c.saved} bytes saved); {c.plain} sent uncompressed, of which {c.plain_would_shrink} "
              f"the codec would have shrunk")
    return missed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=200, help="streams per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16, help="streams in flight per variant")
    p.add_argument("--step-ms", type=float, default=2.0,
                   help="the synthetic engine's time per step (0: flat out; see the module docstring)")
    p.add_argument("--warmup", type=int, default=0, help="streams per variant, at once, before the rounds "
                   "(default: --concurrency)")
    p.add_argument("--quick", action="store_true", help="32 streams x 2 rounds")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--no-pin", action="store_true", help="do not give the gateway a CPU of its own")
    a = p.parse_args(argv)
    if a.quick:
        a.streams, a.rounds = 32, 2
    t0 = time.perf_counter()
    cpus = sorted(os.sched_getaffinity(0))
    pin = not a.no_pin and len(cpus) >= 2
    if pin:  # the harness and the worker (started by the gateway, inheriting this) on the other CPUs
        os.sched_setaffinity(0, cpus[1:])
    with tempfile.TemporaryDirectory() as state:
        gw = start_gateway(state, Path(state) / "gateway.log", a.step_ms)
        try:
            if pin:
                for tid in os.listdir(f"/proc/{gw.proc.pid}/task"):
                    os.sched_setaffinity(int(tid), cpus[:1])
            kids = _children(gw.proc.pid)
            print(f"gateway pid {gw.proc.pid} (http {gw.http[1]}, grpc {gw.grpc[1]}), synthetic worker {kids}; "
                  f"{len(cpus)} CPUs{', gateway pinned to CPU ' + str(cpus[0]) if pin else ''}; "
                  f"{TOKENS}-token streams, engine step {a.step_ms:g} ms")
            rc = asyncio.run(bench(a, gw))
        finally:
            gw.stop()
    print(f"load average after: {_load()}; {time.perf_counter() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
