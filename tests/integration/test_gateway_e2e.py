"""End to end on 127.0.0.1: `quicserve serve --engine synthetic` (a real gateway process
with a real `quicserve worker --engine synthetic` child over the transport) and real
clients: openai SDK (sync + async, streaming and not), httpx (h1, h2c, TLS h2), curl.

One gateway for the module; the drain test starts its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import httpx
import openai
import orjson
import pytest

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

try:
    import inference.worker  # noqa: F401
    import transport.client  # noqa: F401
except ImportError as e:  # pragma: no cover - while the worker/transport are not in the tree yet
    pytest.skip(f"needs transport.client and inference.worker: {e}", allow_module_level=True)


@dataclass
class Gateway:
    proc: subprocess.Popen[str]
    http: str
    https: str
    lines: list[str]

    @property
    def worker_pid(self) -> int:
        kids: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            kids += [int(x) for x in (task / "children").read_text().split()]
        assert kids, "no worker child"
        return kids[0]

    def metric(self, name: str) -> float:
        text = httpx.get(self.http + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_gateway(tmp: Path, *extra: str) -> Gateway:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--engine", "synthetic", "--port", "0", "--tls-port", "0",
           "--grpc-port", "0", "--quic-port", "0",
           "--state-dir", str(tmp), "--progress", "lines", "--log-level", "warning", *extra]
    env = {"QUICSERVE_SHUTDOWN__GRACE_PERIOD": "0", **os.environ}  # a test that wants one sets it
    return wait_ready(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env))


def wait_ready(proc: subprocess.Popen[str]) -> Gateway:
    """Read a starting ``quicserve serve``'s output until it says it is ready."""
    assert proc.stdout is not None
    lines: list[str] = []
    http = https = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"gateway exited ({proc.wait()}): {lines}")
        lines.append(line)
        if m := re.search(r"listening on (http://\S+)", line):
            http = m.group(1)
        if m := re.search(r"listening on (https://\S+)", line):
            https = m.group(1)
        if line.startswith("quicserve: ready"):
            return Gateway(proc, http, https, lines)
    proc.kill()
    raise AssertionError(f"gateway not ready: {lines}")


def stop_gateway(gw: Gateway, sig: int = signal.SIGTERM) -> int:
    if gw.proc.poll() is None:
        gw.proc.send_signal(sig)
    try:
        return gw.proc.wait(30)
    except subprocess.TimeoutExpired:
        gw.proc.kill()
        raise


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(tmp_path_factory.mktemp("state"), "--worker-option=synthetic_step_ms=2")
    yield g
    assert stop_gateway(g) == 0


def test_running_gateway_never_loaded_jax(gw: Gateway) -> None:
    maps = Path(f"/proc/{gw.proc.pid}/maps").read_text()
    assert "jaxlib" not in maps and "/jax/" not in maps and "libtorch" not in maps
    assert any(line.startswith("quicserve: listening on https://") for line in gw.lines)
    assert re.search(r"cert sha256 [0-9A-Fa-f:]{64,}", "".join(gw.lines))


def test_openai_sync_sdk(gw: Gateway) -> None:
    with openai.OpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=8, seed=7, temperature=0.7)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 8
        text = r.choices[0].message.content
        assert text and r.usage.prompt_tokens > 0
        r2 = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, seed=7, temperature=0.7)
        assert r2.choices[0].message.content == text  # same seed, same tokens (synthetic engine is deterministic)
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, seed=7, temperature=0.7, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        c = client.completions.create(model="tiny", prompt="Once", max_tokens=5)
        assert c.choices[0].text and c.usage.completion_tokens <= 5
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, logprobs=True, top_logprobs=2)
        lp = r.choices[0].logprobs.content
        assert len(lp) == r.usage.completion_tokens and all(x.logprob <= 0 and len(x.top_logprobs) == 2 for x in lp)
        assert "".join(x.token for x in lp) == r.choices[0].message.content


async def test_openai_async_sdk_stream_with_usage(gw: Gateway) -> None:
    async with openai.AsyncOpenAI(base_url=gw.http + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 16
        assert chunks[-2].choices[0].finish_reason in ("length", "stop")
        results = await asyncio.gather(*(client.completions.create(model="tiny", prompt=f"p{i}", max_tokens=4)
                                         for i in range(16)))
        assert all(r.choices[0].text for r in results)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=129)


def test_openai_sdk_over_tls_h2(gw: Gateway) -> None:
    with httpx.Client(http1=False, http2=True, verify=False) as http, \
            openai.OpenAI(base_url=gw.https + "/v1", api_key="unused", max_retries=0, http_client=http) as client:
        r = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.http_response.http_version == "HTTP/2"
        assert r.parse().choices[0].message.content
        stream = client.completions.create(model="tiny", prompt="x", max_tokens=4, stream=True)
        assert "".join(c.choices[0].text for c in stream)


@pytest.mark.parametrize("mode", ["h1", "h2c", "tls-h1", "tls-h2"])
def test_httpx(gw: Gateway, mode: str) -> None:
    tls = mode.startswith("tls")
    h2 = mode.endswith("h2") or mode == "h2c"
    with httpx.Client(base_url=gw.https if tls else gw.http, http1=not h2, http2=h2, verify=False) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.http_version == ("HTTP/2" if h2 else "HTTP/1.1")
        assert r.json()["object"] == "chat.completion"
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            body = s.read()
        assert body.endswith(b"data: [DONE]\n\n")


async def test_many_concurrent_streams_on_one_h2_connection(gw: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gw.http, http1=False, http2=True, timeout=30) as c:
        async def one(i: int) -> bytes:
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 12, "seed": i % 8,
                                                           "temperature": 1.0})
            assert r.http_version == "HTTP/2"
            return r.content

        bodies = await asyncio.gather(*(one(i) for i in range(64)))
    assert all(b.endswith(b"data: [DONE]\n\n") for b in bodies)
    by_seed: dict[int, set[str]] = {}
    for i, b in enumerate(bodies):
        chunks = [orjson.loads(x[6:]) for x in b.split(b"\n\n") if x.startswith(b"data: {")]
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
        by_seed.setdefault(i % 8, set()).add(text)
    # same seed -> same text on every stream (no cross-talk), different seeds -> different texts
    assert all(len(t) == 1 for t in by_seed.values()), by_seed
    assert len({next(iter(t)) for t in by_seed.values()}) > 1


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl binary not installed")
@pytest.mark.parametrize("flag", ["--http1.1", "--http2", "--http2-prior-knowledge"])
def test_curl(gw: Gateway, flag: str) -> None:
    base = gw.https if flag == "--http2" else gw.http
    out = subprocess.run(["curl", "-sS", "-k", flag, "-w", "\n%{http_version} %{http_code}", base + "/v1/chat/completions",
                          "-H", "content-type: application/json", "-d", orjson.dumps(CHAT).decode()],
                         capture_output=True, text=True, timeout=30)
    body, _, tail = out.stdout.rpartition("\n")
    version, code = tail.split()
    assert code == "200" and version == ("1.1" if flag == "--http1.1" else "2"), out.stderr
    assert orjson.loads(body)["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "method, path, body, status, code",
    [
        ("POST", "/v1/chat/completions", b"{oops", 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": "\xc3"}', 400, "invalid_utf8"),
        ("POST", "/v1/chat/completions", orjson.dumps({**CHAT, "temperature": "warm"}), 400, "invalid_type"),
        ("POST", "/v1/chat/completions", orjson.dumps({**CHAT, "model": "no-such-model"}), 404, "model_not_found"),
        ("POST", "/v1/completions", orjson.dumps({"model": "tiny", "prompt": "x", "suffix": "y"}), 400,
         "unsupported_parameter"),
        ("GET", "/v1/nothing", b"", 404, "unknown_url"),
        ("PUT", "/v1/chat/completions", b"", 405, "method_not_allowed"),
        ("POST", "/v1/chat/completions", b"x" * (2 << 20), 413, None),
    ],
)
def test_bad_input_then_next_request(gw: Gateway, method: str, path: str, body: bytes, status: int,
                                     code: str | None) -> None:
    with httpx.Client(base_url=gw.http) as c:
        r = c.request(method, path, content=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"]
        if code:
            assert err["code"] == code
    r = httpx.post(gw.http + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200


def test_headers_too_large_431(gw: Gateway) -> None:
    r = httpx.get(gw.http + "/healthz", headers={"x-big": "a" * (20 << 10)})
    assert r.status_code == 431
    assert httpx.get(gw.http + "/healthz").status_code == 200


def test_health_ready_metrics(gw: Gateway) -> None:
    assert httpx.get(gw.http + "/healthz").json() == {"status": "ok"}
    r = httpx.get(gw.http + "/readyz")
    assert r.status_code == 200 and r.json()["models"] == ["tiny"]
    # TTFT and time per output token are measured on streamed responses
    r = httpx.post(gw.http + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    text = httpx.get(gw.http + "/metrics").text
    for name in ("quicserve_requests_total", "quicserve_time_to_first_token_seconds_bucket",
                 "quicserve_time_per_output_token_seconds_bucket", "quicserve_request_duration_seconds_bucket",
                 "quicserve_requests_in_flight", "quicserve_worker_running"):
        assert name in text, name


def test_client_disconnect_cancels_on_the_worker(gw: Gateway) -> None:
    """A 4000-token stream at 2 ms/step would run 8 s; dropping the client must free it at once."""
    with httpx.Client(base_url=gw.http, timeout=10) as c:
        with c.stream("POST", "/v1/chat/completions",
                      json={**CHAT, "max_tokens": 4000, "stream": True}) as s:
            it = s.iter_bytes()
            next(it)
            next(it)
            assert gw.metric("quicserve_worker_in_flight") == 1
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and gw.metric("quicserve_worker_in_flight"):
        time.sleep(0.05)
    assert gw.metric("quicserve_worker_in_flight") == 0  # the gateway's stream ended (Cancel went out)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and gw.metric("quicserve_worker_running"):
        time.sleep(0.1)
    assert gw.metric("quicserve_worker_running") == 0  # and the worker freed the sequence


def test_client_disconnect_cancels_a_non_streaming_request_on_the_worker(gw: Gateway) -> None:
    """The task-free non-streaming path (gateway.api.unary) over real sockets: a client that
    goes away mid-generation gets its worker request cancelled and the sequence freed."""
    body = orjson.dumps({**CHAT, "max_tokens": 4000})
    host, port = gw.http.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and gw.metric("quicserve_worker_running") != 1:
            time.sleep(0.05)
        assert gw.metric("quicserve_worker_in_flight") == 1 and gw.metric("quicserve_worker_running") == 1
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and (gw.metric("quicserve_worker_in_flight")
                                           or gw.metric("quicserve_worker_running")):
        time.sleep(0.05)
    assert gw.metric("quicserve_worker_in_flight") == 0 and gw.metric("quicserve_worker_running") == 0
    r = httpx.post(gw.http + "/v1/chat/completions", json={**CHAT, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # still serving


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_in_flight_then_stops_workers(tmp_path: Path, sig: signal.Signals) -> None:
    g = start_gateway(tmp_path, "--worker-option=synthetic_step_ms=5", "--no-tls")
    worker = g.worker_pid
    with httpx.Client(base_url=g.http, timeout=20) as c:
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 200, "stream": True}) as s:
            it = s.iter_bytes()
            first = next(it)
            os.kill(g.proc.pid, sig)
            body = first + b"".join(it)
    assert body.endswith(b"data: [DONE]\n\n")  # the in-flight stream finished (200 x 5 ms < the deadline)
    assert stop_gateway(g) == 0
    rest = g.proc.stdout.read() if g.proc.stdout else ""
    assert "quicserve: stopped" in rest
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(worker, 0)
            time.sleep(0.05)
    with pytest.raises(httpx.ConnectError):
        httpx.get(g.http + "/healthz")


async def test_drain_deadline_ends_every_stream_with_an_error_event(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICSERVE_SHUTDOWN__DRAIN_TIMEOUT", "0.5")
    g = start_gateway(tmp_path, "--worker-option=synthetic_step_ms=5", "--no-tls")
    t0 = time.monotonic()
    started = asyncio.Event()
    n = 0

    async def one(c: httpx.AsyncClient) -> bytes:
        nonlocal n
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 4000, "stream": True}) as s:
            parts = []
            async for part in s.aiter_bytes():
                parts.append(part)
                n += 1
                if n >= 20:
                    started.set()
            return b"".join(parts)

    async def h2_streams(k: int) -> list[bytes]:
        """k streams on one raw h2 connection (httpx fails a stream once GOAWAY arrives, however the
        server goes on to finish it: httpcore reads GOAWAY as the end of every stream)."""
        host, port = g.http.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        body = orjson.dumps({**CHAT, "max_tokens": 4000, "stream": True})
        data: dict[int, list[bytes]] = {}
        for _ in range(k):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
                                    (":authority", "x"), ("content-type", "application/json")])
            conn.send_data(sid, body, end_stream=True)
            data[sid] = []
        writer.write(conn.data_to_send())
        open_ = set(data)
        buf = b""
        while open_:
            chunk = await asyncio.wait_for(reader.read(65536), 20)
            assert chunk, "connection closed with streams open"
            buf += chunk
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n = 9 + int.from_bytes(buf[:3], "big")
                frame, buf = buf[:n], buf[n:]  # one frame at a time: see ConnectionTerminated below
                for ev in conn.receive_data(frame):
                    if isinstance(ev, h2.events.DataReceived):
                        data[ev.stream_id].append(ev.data)
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                        open_.discard(ev.stream_id)
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        # A graceful GOAWAY (RFC 9113 6.8: streams up to last_stream_id go on), which h2's
                        # client state machine takes as the end of everything: keep reading.
                        assert ev.error_code == 0 and ev.last_stream_id >= max(data)
                        conn.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
            writer.write(conn.data_to_send())
        writer.close()
        return [b"".join(v) for v in data.values()]

    async with httpx.AsyncClient(base_url=g.http, timeout=20) as h1:
        tasks = [asyncio.create_task(one(h1)) for _ in range(10)]
        h2_task = asyncio.create_task(h2_streams(10))
        await asyncio.wait_for(started.wait(), 20)
        await asyncio.sleep(0.3)
        os.kill(g.proc.pid, signal.SIGTERM)
        bodies = [*await asyncio.gather(*tasks), *await h2_task]
    assert time.monotonic() - t0 < 15  # 4000 x 5 ms would have been 20 s
    for body in bodies:  # every stream ends with an explicit error event, none silently
        last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        err = orjson.loads(last.removeprefix(b"data: "))["error"]
        assert err["code"] == "shutting_down" and b"[DONE]" not in body
    assert stop_gateway(g) == 0
    rest = g.proc.stdout.read() if g.proc.stdout else ""
    assert "20 request(s) ended with a shutting_down error" in rest


async def test_readiness_turns_503_during_the_grace_period(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICSERVE_SHUTDOWN__GRACE_PERIOD", "3")
    g = start_gateway(tmp_path, "--no-tls")
    async with httpx.AsyncClient(base_url=g.http, timeout=10) as c:
        assert (await c.get("/readyz")).status_code == 200
        os.kill(g.proc.pid, signal.SIGTERM)
        for _ in range(100):
            r = await c.get("/readyz")
            if r.status_code == 503:
                break
            await asyncio.sleep(0.02)
        assert r.status_code == 503 and r.json()["reason"] == "draining"
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert (await c.get("/healthz")).status_code == 200  # still listening
    assert stop_gateway(g) == 0


def test_remote_worker_by_url(tmp_path: Path) -> None:
    """A worker started on its own (`quicserve worker`), given to the gateway by URL."""
    worker = subprocess.Popen([sys.executable, "-m", "gateway.cli", "worker", "--engine", "synthetic"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        url = ""
        for line in worker.stdout:
            ev = orjson.loads(line) if line.startswith("{") else {}
            if ev.get("event") == "ready":
                url = ev["url"]
                break
        assert url.startswith("tcp://127.0.0.1:")
        g = start_gateway(tmp_path, "--no-tls", "--worker-url", url)
        try:
            with pytest.raises(AssertionError):
                g.worker_pid  # noqa: B018 - no local worker child was started
            r = httpx.post(g.http + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8
        finally:
            assert stop_gateway(g) == 0
        assert worker.poll() is None  # the gateway does not stop workers it did not start
    finally:
        worker.terminate()
        worker.wait(20)


def test_crashed_worker_is_restarted(tmp_path: Path) -> None:
    g = start_gateway(tmp_path, "--no-tls")
    try:
        old = g.worker_pid
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        new = old
        while time.monotonic() < deadline:
            r = httpx.get(g.http + "/readyz")
            if r.status_code == 200:
                with contextlib.suppress(AssertionError):
                    new = g.worker_pid
                if new != old:
                    break
            time.sleep(0.1)
        assert new != old, "worker was not restarted"
        r = httpx.post(g.http + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        assert g.metric("quicserve_worker_restarts_total") == 1
    finally:
        assert stop_gateway(g) == 0


async def test_two_workers_share_the_load(tmp_path: Path) -> None:
    g = start_gateway(tmp_path, "--no-tls", "--workers", "2", "--worker-option=synthetic_step_ms=10")
    try:
        async with httpx.AsyncClient(base_url=g.http, timeout=30) as c:
            for _ in range(200):  # "ready" means the first worker; wait for both
                if (await c.get("/readyz")).json().get("workers") == 2:
                    break
                await asyncio.sleep(0.05)
            reqs = [asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100}))
                    for _ in range(20)]
            await asyncio.sleep(0.5)
            text = (await c.get("/metrics")).text
            per_worker = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("quicserve_worker_in_flight{")]
            results = await asyncio.gather(*reqs)
        assert len(per_worker) == 2 and sum(per_worker) == 20
        assert min(per_worker) >= 8, per_worker  # least-loaded: an even split, give or take
        assert all(r.status_code == 200 for r in results)
    finally:
        assert stop_gateway(g) == 0


def test_unix_socket_listener_from_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "gw.sock"
    monkeypatch.setenv("QUICSERVE_SERVER__UNIX_SOCKET", str(sock))
    g = start_gateway(tmp_path, "--no-tls")
    try:
        assert any(f"listening on unix:{sock}" in line for line in g.lines), g.lines
        for http2 in (False, True):
            transport = httpx.HTTPTransport(uds=str(sock), http1=not http2, http2=http2)
            with httpx.Client(transport=transport, base_url="http://gw", timeout=20) as c:
                r = c.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 8
                assert r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    finally:
        assert stop_gateway(g) == 0
    assert not sock.exists()  # removed on close


async def test_http3_from_serve_and_alt_svc_on_tls(tmp_path: Path) -> None:
    """serve opens UDP beside TLS; TLS responses over h1 and h2 advertise it; h3 serves a completion."""
    from tests.gateway.http.h3_client import h3_connect

    g = start_gateway(tmp_path)
    try:
        quic = next(m.group(1) for line in g.lines if (m := re.search(r"listening on https://\S+:(\d+) \(h3", line)))
        for http2 in (False, True):
            async with httpx.AsyncClient(verify=False, http1=not http2, http2=http2) as c:
                r = await c.get(g.https + "/v1/models")
                assert r.status_code == 200 and r.headers["alt-svc"] == f'h3=":{quic}"; ma=86400'
        async with h3_connect(int(quic)) as client:
            r3 = await client.request("POST", "/v1/chat/completions", orjson.dumps(CHAT),
                                      [(b"content-type", b"application/json")])
        assert r3.status == 200 and r3.json()["usage"]["completion_tokens"] <= 8
        assert httpx.get(g.http + "/v1/models").headers.get("alt-svc") is None  # cleartext: no h3 to offer
    finally:
        assert stop_gateway(g) == 0
