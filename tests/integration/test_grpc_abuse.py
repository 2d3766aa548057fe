"""Hostile and broken clients against the gRPC port and against streamed bodies on the HTTP ports.

Each test drives a real client (the raw h2 client of tests/gateway/grpc/h2_client.py, a raw
socket for HTTP/1.1, aioquic's client) at a real listener on 127.0.0.1 port 0 and checks the
house rules: bad input gets a clear error (a gRPC status; an HTTP status or a reset where gRPC
cannot apply), the server keeps serving, every call ends exactly once (a client that goes away
cancels the worker's request: the ScriptedWorkerConnection double's ``cancels``), and what a
client may make the gateway hold stays bounded (flow control: what the server acknowledges).
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import h2.errors
import h2.events
import h2.exceptions
import pytest
from aioquic.h3.connection import FrameUnexpected
from hyperframe.frame import DataFrame

from gateway.app import App
from gateway.grpc.compression import Codecs
from gateway.grpc.grpc_web_route import GrpcWebRoute
from gateway.grpc.mount import mount_grpc
from gateway.grpc.native_server import NativeServer, start_native
from gateway.grpc.pipeline_backend import PipelineBackend
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb
from gateway.grpc.service import InferenceService
from gateway.http.common import HttpLimits, task_entrance
from gateway.http.listeners import ListenerSpec, StreamListener, start_listener
from gateway.http.quic_listener import QuicListener, start_quic_listener
from gateway.http.quic_settings import QuicSettings
from gateway.routing.pool import ModelPool
from gateway.settings import ApiSettings, GrpcSettings
from tests.gateway.doubles import ScriptedWorkerConnection
from tests.gateway.grpc.h2_client import RawH2
from tests.gateway.grpc.web_client import CODECS, frame
from tests.gateway.http.h3_client import H3Client, H3Response, h3_connect, make_cert

pytestmark = pytest.mark.timeout(60)

METHOD = "/quicserve.v1.Inference/"
MAX_MESSAGE = 64 << 10
GRPC = [(b"content-type", b"application/grpc"), (b"te", b"trailers")]


@dataclass
class Native:
    server: NativeServer
    worker: ScriptedWorkerConnection
    app: App

    @property
    def port(self) -> int:
        return self.server.port


@asynccontextmanager
async def native(worker: ScriptedWorkerConnection | None = None, limits: HttpLimits | None = None,
                 write_timeout: float | None = None) -> AsyncIterator[Native]:
    """The gRPC port on the real pipeline, the scripted worker behind it (``write_timeout``: the
    port's and the app's, which native Generate's generation call applies)."""
    w = worker or ScriptedWorkerConnection()
    pool = ModelPool()
    pool.add(w)
    app = App(pool, api=None if write_timeout is None else ApiSettings(write_timeout=write_timeout))
    server = await start_native(PipelineBackend(pool, app.generations, app.openai), "127.0.0.1", 0,
                                max_message=MAX_MESSAGE, limits=limits, write_timeout=write_timeout)
    try:
        yield Native(server, w, app)
    finally:
        await server.close(timeout=1)


def _generate(max_tokens: int = 3) -> bytes:
    return pb.GenerateRequest(model="tiny", prompt="hi", sampling=pb.Sampling(max_tokens=max_tokens)).SerializeToString()


def _turn(text: str = "hi", max_tokens: int = 3, model: str = "tiny") -> bytes:
    return frame(pb.ChatRequest(turn=pb.Turn(model=model, messages=[pb.Message(role="user", content=text)],
                                             sampling=pb.Sampling(max_tokens=max_tokens))).SerializeToString())


def _status(c: RawH2, sid: int) -> tuple[int, str]:
    """The call's grpc-status and grpc-message, from its trailers (or a trailers-only response)."""
    blocks = c.headers(sid)
    last = blocks[-1]
    assert blocks[0][b":status"] == b"200", blocks
    return int(last[b"grpc-status"]), last.get(b"grpc-message", b"").decode()


def _messages(body: bytes) -> list[bytes]:
    out, pos = [], 0
    while len(body) - pos >= 5:
        n = int.from_bytes(body[pos + 1:pos + 5], "big")
        out.append(body[pos + 5:pos + 5 + n])
        pos += 5 + n
    return out


async def _still_serving(port: int, worker: ScriptedWorkerConnection | None = None) -> None:
    if worker is not None:
        worker.hang_after = None
    async with RawH2(port) as c:
        sid = c.request(METHOD + "Complete", GRPC)
        c.data(sid, frame(_generate(3)), end=True)
        await c.until(lambda: c.ended(sid))
    assert _status(c, sid) == (0, "")
    assert pb.GenerateResponse.FromString(_messages(c.body(sid))[0]).text == "abc"


async def _settled(n: Native) -> None:
    """Every call ended once: nothing in flight at the pipeline, the listener or the worker."""
    async with asyncio.timeout(5):
        while n.app.metrics.in_flight or n.server.in_flight or n.worker.in_flight:
            await asyncio.sleep(0.01)


# -- the gRPC port: malformed messages ----------------------------------------------------------

async def test_a_length_prefix_past_the_limit_is_resource_exhausted_before_the_body() -> None:
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Complete", GRPC)
            c.data(sid, b"\x00\x7f\xff\xff\xff" + b"x" * 10)  # announces 2 GiB; the body never ends
            await c.until(lambda: c.ended(sid))
            code, message = _status(c, sid)
            assert code == 8 and "exceeds the limit" in message
            assert n.worker.submits == []
        await _still_serving(n.port, n.worker)


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
async def test_a_zip_bomb_is_refused_without_inflating_it(encoding: str) -> None:
    codec = CODECS[encoding]
    bomb = codec.compress(pb.GenerateRequest(model="tiny", prompt="a" * (48 << 20)).SerializeToString())
    assert len(bomb) < MAX_MESSAGE  # a small message on the wire, 48 MiB inflated
    async with native() as n:
        async with RawH2(n.port) as c:
            tracemalloc.start()
            try:
                sid = c.request(METHOD + "Complete", [*GRPC, (b"grpc-encoding", encoding.encode())])
                c.data(sid, frame(bomb, 1), end=True)
                await c.until(lambda: c.ended(sid))
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            code, message = _status(c, sid)
            assert code == 8 and "inflates past the limit" in message
            assert peak < 16 << 20  # inflated a step past the limit at most (zstd: 4 MiB), not 48 MiB
        await _still_serving(n.port, n.worker)


@pytest.mark.parametrize("encoding", [None, b"identity"])
async def test_a_compressed_flag_without_an_encoding_is_internal(encoding: bytes | None) -> None:
    headers = GRPC if encoding is None else [*GRPC, (b"grpc-encoding", encoding)]
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Complete", headers)
            c.data(sid, frame(_generate(), 1), end=True)
            await c.until(lambda: c.ended(sid))
            assert _status(c, sid) == (13, "compressed message without a grpc-encoding")
        await _still_serving(n.port, n.worker)


async def test_a_truncated_frame_then_end_stream_is_internal() -> None:
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Complete", GRPC)
            c.data(sid, frame(_generate())[:-3], end=True)
            await c.until(lambda: c.ended(sid))
            code, message = _status(c, sid)
            assert code == 13 and "ends inside a frame" in message
            assert n.worker.submits == []
        await _still_serving(n.port, n.worker)


# -- the gRPC port: headers ----------------------------------------------------------------------

@pytest.mark.parametrize("value", [b"1x", b"99999999999S", b"-1m", b"", b"1.5S", b"1 S"])
async def test_a_malformed_grpc_timeout_is_internal(value: bytes) -> None:
    """As grpc-go answers it (the spec allows at most 8 digits and a unit, nothing else)."""
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Complete", [*GRPC, (b"grpc-timeout", value)])
            c.data(sid, frame(_generate()), end=True)
            await c.until(lambda: c.ended(sid))
            code, message = _status(c, sid)
            assert code == 13 and "grpc-timeout" in message
            assert n.worker.submits == []
        await _still_serving(n.port, n.worker)


async def test_the_largest_grpc_timeout_is_simply_a_long_deadline() -> None:
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Complete", [*GRPC, (b"grpc-timeout", b"99999999H")])
            c.data(sid, frame(_generate()), end=True)
            await c.until(lambda: c.ended(sid))
            assert _status(c, sid) == (0, "")
            assert pb.GenerateResponse.FromString(_messages(c.body(sid))[0]).text == "abc"


@pytest.mark.parametrize("path", ["/quicserve.v1.Inference/Nope", "/no.such.Service/Complete", "/", "/x"])
async def test_an_unknown_method_is_unimplemented(path: str) -> None:
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(path, GRPC)
            c.data(sid, frame(_generate()))  # the body is not even ended: the status comes anyway
            await c.until(lambda: c.ended(sid))
            code, _ = _status(c, sid)
            assert code == 12
        await _still_serving(n.port, n.worker)


# -- the gRPC port: clients that go away, or say they will --------------------------------------

async def test_a_reset_mid_request_cancels_the_workers_request() -> None:
    """RST_STREAM while the call still reads its body (a Chat turn running, the stream open)."""
    async with native(ScriptedWorkerConnection(hang_after=1)) as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Chat", GRPC)
            c.data(sid, _turn(max_tokens=50))
            await c.until(lambda: len(_messages(c.body(sid))) >= 1)
            c.reset(sid)
            await _settled(n)
        assert n.worker.cancels == [1]
        await _still_serving(n.port, n.worker)


async def test_a_reset_mid_response_cancels_the_workers_request() -> None:
    async with native(ScriptedWorkerConnection(hang_after=2)) as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Generate", GRPC)
            c.data(sid, frame(_generate(50)), end=True)
            await c.until(lambda: len(_messages(c.body(sid))) >= 2)
            c.reset(sid)
            await _settled(n)
        assert n.worker.cancels == [1]
        await _still_serving(n.port, n.worker)


async def test_a_reset_before_the_body_ends_frees_the_call() -> None:
    """The call waits in read() for its one message when the client resets: no worker request."""
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Complete", GRPC)
            c.data(sid, frame(_generate())[:4])
            await asyncio.sleep(0.05)
            c.reset(sid)
            await _settled(n)
        assert n.worker.submits == []
        await _still_serving(n.port, n.worker)


async def test_a_lost_connection_cancels_every_call_on_it() -> None:
    async with native(ScriptedWorkerConnection(hang_after=1)) as n:
        async with RawH2(n.port) as c:
            gen = c.request(METHOD + "Generate", GRPC)
            c.data(gen, frame(_generate(50)), end=True)
            chat = c.request(METHOD + "Chat", GRPC)
            c.data(chat, _turn(max_tokens=50))
            waiting = c.request(METHOD + "Complete", GRPC)  # waits in read() for its message
            await c.until(lambda: bool(_messages(c.body(gen))) and bool(_messages(c.body(chat))))
        await _settled(n)
        assert sorted(n.worker.cancels) == [1, 2] and waiting
        await _still_serving(n.port, n.worker)


async def test_a_graceful_goaway_from_the_client_lets_its_calls_finish() -> None:
    """A client's GOAWAY(NO_ERROR) says it opens no more streams (RFC 9113 6.8): the calls it has
    open go on, both ways: turn 2 is read after it and its reply written."""
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Chat", GRPC)
            c.data(sid, _turn("one", 3))
            await c.until(lambda: any(pb.ChatResponse.FromString(m).finish_reason for m in _messages(c.body(sid))))
            c.goaway(last_stream_id=0)
            await asyncio.sleep(0.05)
            c.data(sid, _turn("two", 4), end=True)
            await c.until(lambda: c.ended(sid))
            assert _status(c, sid) == (0, "")
            replies = [pb.ChatResponse.FromString(m) for m in _messages(c.body(sid))]
            assert [r.turn for r in replies if r.finish_reason] == [1, 2]
            assert "".join(r.text for r in replies if r.turn == 2) == "abcd"
        await _settled(n)
        await _still_serving(n.port, n.worker)


async def test_a_goaway_with_an_error_cancels_the_calls() -> None:
    async with native(ScriptedWorkerConnection(hang_after=1)) as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Generate", GRPC)
            c.data(sid, frame(_generate(50)), end=True)
            await c.until(lambda: bool(_messages(c.body(sid))))
            c.goaway(last_stream_id=0, error_code=2)  # INTERNAL_ERROR: the client is giving up
            await _settled(n)
        assert n.worker.cancels == [1]
        await _still_serving(n.port, n.worker)


async def test_rapid_reset_of_calls_started_at_headers_is_cut_off() -> None:
    """Every native call starts at its HEADERS (its body streams): a client that opens and resets
    calls as fast as it can is closed with GOAWAY(ENHANCE_YOUR_CALM) after the allowance, and
    every call it started has ended."""
    async with native() as n:
        async with RawH2(n.port) as c:
            with pytest.raises(h2.exceptions.ProtocolError):  # our side, once the GOAWAY is in
                for i in range(3000):
                    c.reset(c.request(METHOD + "Chat", GRPC))
                    if i % 50 == 0:
                        await asyncio.sleep(0)
            goaway = [e for e in c.events if isinstance(e, h2.events.ConnectionTerminated)]
            assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        await _settled(n)
        assert n.worker.submits == []
        await _still_serving(n.port)

STALL = 0.3  # the body timeout of the stall tests


async def test_a_unary_call_whose_message_never_comes_is_deadline_exceeded() -> None:
    """A streamed body has no adapter body timeout (the call reads it): the call bounds a stall
    while a message is incomplete -- here before a unary call's one message, and inside it."""
    async with native(limits=HttpLimits(body_timeout=STALL)) as n:
        async with RawH2(n.port) as c:
            nothing = c.request(METHOD + "Complete", GRPC)
            part = c.request(METHOD + "Generate", GRPC)
            c.data(part, frame(_generate())[:7])
            await c.until(lambda: c.ended(nothing) and c.ended(part))
            for sid in (nothing, part):
                code, message = _status(c, sid)
                assert code == 4 and "stopped arriving" in message
        await _settled(n)
        assert n.worker.submits == []
        await _still_serving(n.port)


async def test_a_chat_may_idle_between_turns_but_not_inside_one() -> None:
    async with native(limits=HttpLimits(body_timeout=STALL)) as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Chat", GRPC)
            await asyncio.sleep(2 * STALL)  # before the first turn: idle, not stalled
            c.data(sid, _turn("one", 2))
            await c.until(lambda: any(pb.ChatResponse.FromString(m).finish_reason for m in _messages(c.body(sid))))
            await asyncio.sleep(2 * STALL)  # between turns
            turn = _turn("two", 3)
            c.data(sid, turn[:9])  # then inside turn 2
            await c.until(lambda: c.ended(sid))
            code, message = _status(c, sid)
            assert code == 4 and "stopped arriving" in message
            replies = [pb.ChatResponse.FromString(m) for m in _messages(c.body(sid))]
            assert [r.turn for r in replies if r.finish_reason] == [1]
        await _settled(n)
        await _still_serving(n.port)

async def test_a_client_that_reads_nothing_is_cut_off_after_the_write_timeout() -> None:
    """As a streamed HTTP response is ([api] write_timeout): the stream is reset and the
    generation cancelled, instead of the call waiting on the client for ever."""
    async with native(ScriptedWorkerConnection(tokens_per_batch=8, hang_after=1000), write_timeout=0.3) as n:
        async with RawH2(n.port, window=1024, ack=False) as c:
            sid = c.request(METHOD + "Generate", GRPC)
            c.data(sid, frame(_generate(2000)), end=True)
            await c.until(lambda: c.ended(sid))
            assert any(isinstance(e, h2.events.StreamReset) and e.stream_id == sid for e in c.events)
            await _settled(n)
        assert n.worker.cancels == [1]
        await _still_serving(n.port, n.worker)

# -- the gRPC port: what is not gRPC over HTTP/2 ---------------------------------------------------

async def _http1(port: int, head: bytes, timeout: float = 5.0) -> bytes:
    """Send ``head`` (a request without its body) and read what comes back before we send more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        async with asyncio.timeout(timeout):
            return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


async def test_http1_with_a_huge_body_is_refused_before_the_body() -> None:
    """HTTP/1.1 reads a body whole before the route can say 505: the gRPC port must not take a
    body of any size for that (it answers at the headers, as the HTTP port does past its limit)."""
    async with native() as n:
        head = await _http1(n.port, b"POST /quicserve.v1.Inference/Complete HTTP/1.1\r\nHost: x\r\n"
                                    b"content-type: application/grpc\r\ncontent-length: 10000000000\r\n\r\n")
        assert head.split(b" ", 2)[1] in (b"413", b"505")
        await _still_serving(n.port)


@pytest.mark.parametrize("method", [b"GET", b"POST"])
async def test_an_h2c_upgrade_is_not_taken(method: bytes) -> None:
    """The gRPC port speaks h2c with prior knowledge only: an Upgrade is answered over HTTP/1.1
    with a clear error, not 101."""
    async with native() as n:
        head = await _http1(n.port, method + b" /quicserve.v1.Inference/Complete HTTP/1.1\r\nHost: x\r\n"
                                             b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                             b"HTTP2-Settings: AAMAAABkAAQAAP__\r\ncontent-length: 0\r\n\r\n")
        assert head.split(b" ", 2)[1] == (b"405" if method == b"GET" else b"505")
        await _still_serving(n.port)


# -- the gRPC port: memory a client can make it hold -------------------------------------------------

async def _send_while_window(c: RawH2, sid: int, piece: bytes, total: int, settle: float = 0.2) -> int:
    """Send ``piece`` while the windows allow it, up to ``total`` bytes; what was sent."""
    sent = 0
    while sent < total and not c.ended(sid):
        if c.window(sid) < len(piece):
            try:  # a WINDOW_UPDATE, if the server reads
                await c.until(lambda: c.window(sid) >= len(piece) or c.ended(sid), settle)
            except TimeoutError:
                return sent
            if c.ended(sid):
                return sent
        c.data(sid, piece)
        sent += len(piece)
        await asyncio.sleep(0)
    return sent


async def test_chat_turns_flooded_while_a_turn_runs_are_not_all_taken_in() -> None:
    """A Chat client that sends turn after turn while turn 1 hangs: the server queues a few and
    then stops reading, so flow control stops the client (nothing past the stream window and a
    few turns is taken in), instead of queueing every turn in memory."""
    async with native(ScriptedWorkerConnection(hang_after=1)) as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Chat", GRPC)
            c.data(sid, _turn(max_tokens=50))
            await c.until(lambda: bool(_messages(c.body(sid))))
            sent = await _send_while_window(c, sid, _turn("x" * 60_000), 64 << 20)
            assert sent < 4 << 20  # the stream window is 1 MiB
            c.reset(sid)
            await _settled(n)
        assert n.worker.cancels == [1] and len(n.worker.submits) == 1


async def test_a_long_native_chat_is_not_capped_by_the_body_limit() -> None:
    """Over HTTP/2 a native call's body is read as it arrives: each message is bounded by
    max_message and what is unread by flow control, so a Chat may send more in all than the
    listener's body limit (1 MiB here) and every turn is answered."""
    async with native() as n:
        async with RawH2(n.port) as c:
            sid = c.request(METHOD + "Chat", GRPC)
            turn = _turn("x" * 60_000, 1)
            sent = await _send_while_window(c, sid, turn, 2 << 20, settle=5.0)
            assert sent >= 2 << 20
            c.end(sid)
            await c.until(lambda: c.ended(sid), 30)
            assert _status(c, sid)[0] == 0
            finished = [m for m in map(pb.ChatResponse.FromString, _messages(c.body(sid))) if m.finish_reason]
            assert len(finished) == sent // len(turn)
        await _settled(n)
        await _still_serving(n.port)


async def test_many_slow_streams_are_held_to_the_connection_window() -> None:
    """Calls that do not read the rest of their body (a unary call has its message): each stream
    holds at most its window, the connection at most its window, whatever the client sends."""
    async with native(ScriptedWorkerConnection(hang_after=1)) as n:
        async with RawH2(n.port) as c:
            sids = [c.request(METHOD + "Generate", GRPC) for _ in range(24)]
            for sid in sids:
                c.data(sid, frame(_generate(50)))
            await c.until(lambda: all(_messages(c.body(sid)) for sid in sids))
            sent = 0
            for sid in sids:
                sent += await _send_while_window(c, sid, b"\0" * 16384, 4 << 20, settle=0.01)
            assert sent <= 16 << 20  # the connection window
            for sid in sids:
                c.reset(sid)
            await _settled(n)
        assert len(n.worker.cancels) == 24
        await _still_serving(n.port, n.worker)


async def test_a_client_that_never_reads_holds_no_more_than_its_window() -> None:
    """Flow control, not memory, holds back what a client does not read; its call ends when the
    client resets it, the worker's request long finished."""
    async with native(ScriptedWorkerConnection(tokens_per_batch=8)) as n:
        async with RawH2(n.port, window=1024, ack=False) as c:
            sid = c.request(METHOD + "Generate", GRPC)
            c.data(sid, frame(_generate(2000)), end=True)
            async with asyncio.timeout(10):
                while n.worker.in_flight or not n.worker.submits:
                    await asyncio.sleep(0.02)  # the worker has finished; the reply waits on the client
            await asyncio.sleep(0.2)
            assert not c.ended(sid) and len(c.body(sid)) <= 1024
            assert n.server.in_flight == 1
            c.reset(sid)
            await _settled(n)
        await _still_serving(n.port)


# -- streamed bodies on the HTTP ports: gRPC-Web over HTTP/2 and HTTP/3 ----------------------------

WEB = [(b"content-type", b"application/grpc-web+proto"), (b"x-grpc-web", b"1")]
WEB_BODY_LIMIT = 64 << 10


@dataclass
class Web:
    app: App
    worker: ScriptedWorkerConnection
    tcp: StreamListener
    quic: QuicListener

    @property
    def h2_port(self) -> int:
        return self.tcp.port

    @property
    def h3_port(self) -> int:
        return self.quic.address[1]


@asynccontextmanager
async def web(tmp_path: Path, worker: ScriptedWorkerConnection | None = None,
              stall: float | None = None, write_timeout: float | None = None) -> AsyncIterator[Web]:
    """The app with gRPC-Web mounted as serve mounts it, behind an HTTP/1.1+h2c and a QUIC listener
    (a small body limit on both); ``stall``, ``write_timeout``: the route's instead of its defaults."""
    w = worker or ScriptedWorkerConnection()
    pool = ModelPool()
    pool.add(w)
    app = App(pool)
    if stall is None and write_timeout is None:
        await mount_grpc(app, GrpcSettings(port=-1), "127.0.0.1")
    else:  # as mount_grpc mounts it
        handlers = InferenceService(PipelineBackend(pool, app.generations, app.openai)).__mapping__()
        route = GrpcWebRoute(handlers, Codecs(), MAX_MESSAGE, stall_timeout=30.0 if stall is None else stall,
                             write_timeout=write_timeout)
        app.mount(handlers, task_entrance(route), route.streams_body)
    tcp = await start_listener(app.handle, ListenerSpec("tcp", "127.0.0.1", 0), streams_body=app.streams_body,
                               limits=HttpLimits(max_body_bytes=WEB_BODY_LIMIT))
    cert, key = make_cert(tmp_path)
    quic = await start_quic_listener(app.handle, "127.0.0.1", 0, cert, key,
                                     QuicSettings(max_body_bytes=WEB_BODY_LIMIT), streams_body=app.streams_body)
    try:
        yield Web(app, w, tcp, quic)
    finally:
        await quic.close()
        await tcp.close()


class Duplex:
    """One full-duplex call, the same steps over the raw h2 client or aioquic's h3 client."""

    def __init__(self, h2c: RawH2 | None = None, h3c: H3Client | None = None) -> None:
        self.h2c, self.h3c = h2c, h3c
        self.sid = -1

    def open(self, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        if self.h2c is not None:
            self.sid = self.h2c.request(path, headers)
            return
        assert self.h3c is not None
        self.sid = self.h3c._quic.get_next_available_stream_id()
        self.h3c.h3.send_headers(self.sid, [(b":method", b"POST"), (b":scheme", b"https"),
                                            (b":authority", b"127.0.0.1"), (b":path", path.encode()), *headers])
        self.h3c.responses[self.sid] = H3Response(self.sid)
        self.h3c.transmit()

    def send(self, data: bytes, end: bool = False) -> None:
        if self.h2c is not None:
            return self.h2c.data(self.sid, data, end)
        assert self.h3c is not None
        self.h3c.h3.send_data(self.sid, data, end)
        self.h3c.transmit()

    def late(self, data: bytes) -> None:
        """DATA whatever the stream's state (the server may have ended or reset it): over h2 a
        frame built by hand; over h3 what aioquic's stack still lets out (nothing once the
        server's STOP_SENDING arrived)."""
        if self.h2c is not None:
            for i in range(0, len(data), 16384):  # the server's SETTINGS_MAX_FRAME_SIZE
                self.h2c.raw(DataFrame(self.sid, data[i:i + 16384]).serialize())
            return
        try:
            self.send(data)
        except (FrameUnexpected, ValueError):
            pass

    def reset(self) -> None:
        if self.h2c is not None:
            return self.h2c.reset(self.sid)
        assert self.h3c is not None
        self.h3c.cancel(self.h3c.responses[self.sid])

    def body(self) -> bytes:
        if self.h2c is not None:
            return self.h2c.body(self.sid)
        assert self.h3c is not None
        return self.h3c.responses[self.sid].body

    def ended(self) -> bool:
        if self.h2c is not None:
            return self.h2c.ended(self.sid)
        assert self.h3c is not None
        return self.h3c.responses[self.sid].done.is_set()

    async def until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.005)

    def replies(self) -> list[pb.ChatResponse]:
        return [pb.ChatResponse.FromString(m) for m in _web_frames(self.body())[0]]

    def trailers(self) -> dict[str, str] | None:
        return _web_frames(self.body())[1]


def _web_frames(body: bytes) -> tuple[list[bytes], dict[str, str] | None]:
    messages, trailers, pos = [], None, 0
    while len(body) - pos >= 5 and len(body) - pos >= 5 + (n := int.from_bytes(body[pos + 1:pos + 5], "big")):
        payload = body[pos + 5:pos + 5 + n]
        if body[pos] & 0x80:
            trailers = dict(line.split(":", 1) for line in payload.decode().split("\r\n") if line)
        else:
            messages.append(payload)
        pos += 5 + n
    return messages, trailers


@asynccontextmanager
async def duplex(w: Web, proto: str) -> AsyncIterator[Duplex]:
    if proto == "h2":
        async with RawH2(w.h2_port) as c:
            yield Duplex(h2c=c)
    else:
        async with h3_connect(w.h3_port) as q:
            yield Duplex(h3c=q)


async def _web_settled(w: Web) -> None:
    """Every call ended once: nothing in flight at the pipeline, the listeners or the worker."""
    async with asyncio.timeout(5):
        while w.app.metrics.in_flight or w.worker.in_flight or w.tcp.in_flight or w.quic.in_flight:
            await asyncio.sleep(0.01)


async def _web_serving(w: Web, proto: str) -> None:
    w.worker.hang_after = None
    async with duplex(w, proto) as d:
        d.open("/quicserve.v1.Inference/Chat", WEB)
        d.send(_turn("again", 3), end=True)
        await d.until(d.ended)
        assert d.trailers() == {"grpc-status": "0"}
        assert "".join(r.text for r in d.replies()) == "abc"


PROTOS = pytest.mark.parametrize("proto", ["h2", "h3"])


@PROTOS
async def test_web_chat_turns_after_the_trailers_are_dropped(tmp_path: Path, proto: str) -> None:
    """The call has ended (a malformed message: INTERNAL in the trailer frame); the client goes on
    sending turns on the stream: nothing runs them, nothing breaks."""
    async with web(tmp_path) as w:
        async with duplex(w, proto) as d:
            d.open("/quicserve.v1.Inference/Chat", WEB)
            d.send(_turn("one", 3))
            await d.until(lambda: any(r.finish_reason for r in d.replies()))
            d.send(frame(b"\xff\xff\xff", 0))  # not a ChatRequest
            await d.until(lambda: d.trailers() is not None)
            assert d.trailers()["grpc-status"] == "13"  # type: ignore[index]
            for _ in range(5):
                d.late(_turn("late", 3))
                await asyncio.sleep(0.01)
            await _web_settled(w)
            assert len(w.worker.submits) == 1
        await _web_serving(w, proto)


@PROTOS
async def test_web_chat_turns_after_a_reset_are_dropped(tmp_path: Path, proto: str) -> None:
    """The client resets the call (the worker's request is cancelled), then sends turns on the
    stream anyway: nothing runs them, and the connection serves on."""
    async with web(tmp_path, ScriptedWorkerConnection(hang_after=1)) as w:
        async with duplex(w, proto) as d:
            d.open("/quicserve.v1.Inference/Chat", WEB)
            d.send(_turn("one", 30))
            await d.until(lambda: bool(d.replies()))
            d.reset()
            await _web_settled(w)
            assert w.worker.cancels == [1]
            for _ in range(3):
                d.late(_turn("late", 3))
                await asyncio.sleep(0.01)
            w.worker.hang_after = None
            again = Duplex(d.h2c, d.h3c)  # the same connection
            again.open("/quicserve.v1.Inference/Chat", WEB)
            again.send(_turn("two", 2), end=True)
            await again.until(again.ended)
            assert again.trailers() == {"grpc-status": "0"}
            assert len(w.worker.submits) == 2
        await _web_serving(w, proto)


@PROTOS
async def test_web_chat_turns_after_a_cancel_turn_go_on(tmp_path: Path, proto: str) -> None:
    async with web(tmp_path, ScriptedWorkerConnection(hang_after=1)) as w:
        async with duplex(w, proto) as d:
            d.open("/quicserve.v1.Inference/Chat", WEB)
            d.send(_turn("one", 30))
            await d.until(lambda: bool(d.replies()))
            d.send(frame(pb.ChatRequest(cancel=pb.CancelTurn(turn=1)).SerializeToString()))
            await d.until(lambda: any(r.HasField("error") for r in d.replies()))
            assert w.worker.cancels == [1]
            w.worker.hang_after = None
            d.send(_turn("two", 2), end=True)
            await d.until(d.ended)
            assert d.trailers() == {"grpc-status": "0"}
            assert [r.turn for r in d.replies() if r.finish_reason] == [2]
        await _web_settled(w)


@PROTOS
async def test_web_chat_body_past_the_limit_is_resource_exhausted(tmp_path: Path, proto: str) -> None:
    async with web(tmp_path) as w:
        async with duplex(w, proto) as d:
            d.open("/quicserve.v1.Inference/Chat", WEB)
            for _ in range(WEB_BODY_LIMIT // 20_000 + 2):
                d.late(_turn("x" * 20_000, 1))  # the server may have answered already
                await asyncio.sleep(0.01)
            await d.until(lambda: d.trailers() is not None)
            assert d.trailers()["grpc-status"] == "8"  # type: ignore[index]
            await _web_settled(w)
        await _web_serving(w, proto)


@PROTOS
async def test_web_chat_half_closed_at_once_ends_ok(tmp_path: Path, proto: str) -> None:
    async with web(tmp_path) as w:
        async with duplex(w, proto) as d:
            d.open("/quicserve.v1.Inference/Chat", WEB)
            d.send(b"", end=True)
            await d.until(d.ended)
            assert d.trailers() == {"grpc-status": "0"} and d.replies() == []
        assert w.worker.submits == []


@PROTOS
async def test_web_connection_lost_while_the_call_waits_in_read(tmp_path: Path, proto: str) -> None:
    """The connection goes while one call waits for its next turn and another for its only
    message: both end, nothing is left in flight."""
    async with web(tmp_path) as w:
        async with duplex(w, proto) as d:
            d.open("/quicserve.v1.Inference/Chat", WEB)
            d.send(_turn("one", 3))
            await d.until(lambda: any(r.finish_reason for r in d.replies()))
            unary = Duplex(d.h2c, d.h3c)
            unary.open("/quicserve.v1.Inference/Complete", WEB)
            unary.send(frame(_generate())[:3])
            await asyncio.sleep(0.05)
            assert w.app.metrics.in_flight == 0  # the turn is over: the calls wait in read()
        await _web_settled(w)
        await _web_serving(w, proto)


@PROTOS
async def test_web_calls_stalled_inside_a_message_are_deadline_exceeded(tmp_path: Path, proto: str) -> None:
    async with web(tmp_path, stall=STALL) as w:
        async with duplex(w, proto) as d:
            d.open("/quicserve.v1.Inference/Complete", WEB)  # its one message never comes
            chat = Duplex(d.h2c, d.h3c)
            chat.open("/quicserve.v1.Inference/Chat", WEB)
            await asyncio.sleep(2 * STALL)  # a Chat may idle before (and between) its turns
            chat.send(_turn("one", 2)[:9])  # but not inside one
            await d.until(lambda: d.ended() and chat.ended())
            for call in (d, chat):
                trailers = call.trailers()
                assert trailers is not None and trailers["grpc-status"] == "4"
                assert "stopped arriving" in trailers["grpc-message"]
        await _web_settled(w)
        assert w.worker.submits == []
        await _web_serving(w, proto)


async def test_web_client_that_reads_nothing_is_cut_off_after_the_write_timeout(tmp_path: Path) -> None:
    async with web(tmp_path, ScriptedWorkerConnection(tokens_per_batch=8, hang_after=1000), write_timeout=0.3) as w:
        async with RawH2(w.h2_port, window=1024, ack=False) as c:
            sid = c.request("/quicserve.v1.Inference/Generate", WEB)
            c.data(sid, frame(_generate(2000)), end=True)
            await c.until(lambda: c.ended(sid))
            assert any(isinstance(e, h2.events.StreamReset) and e.stream_id == sid for e in c.events)
        await _web_settled(w)
        assert w.worker.cancels == [1]
        await _web_serving(w, "h2")
