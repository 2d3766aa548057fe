"""Real sockets on loopback: TCP and Unix, under asyncio and uvloop, with a test-double worker."""

from __future__ import annotations

import asyncio
import socket
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from tests.transport.doubles import EchoWorker
from transport.api import RequestStream, StreamEvent, WorkerConnection
from transport.client import connect
from transport.errors import ConnectError, ConnectionClosed, ProtocolError
from transport.messages import Error, ErrorCode, Finish, Hello, SamplingParams, Submit, TokenEntry
from transport.server import serve
from transport.wire import FrameEncoder

LOOPS = ["asyncio", "uvloop"]


def run(loop_kind: str, fn: Callable[[], Awaitable[None]], limit: float = 20.0) -> None:
    factory = uvloop.new_event_loop if loop_kind == "uvloop" else asyncio.new_event_loop

    async def bounded() -> None:
        async with asyncio.timeout(limit):
            await fn()

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(bounded())


def listen_url(kind: str, tmp: str) -> str:
    return f"unix://{tmp}/w.sock" if kind == "unix" else "tcp://127.0.0.1:0"


async def collect(stream: RequestStream) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    while True:
        try:
            out.extend(await stream.next_events())
        except StopAsyncIteration:
            return out


def tokens_of(events: list[StreamEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenEntry) for t in e.token_ids]


def submit(conn: WorkerConnection, max_tokens: int, model: str = "tiny") -> RequestStream:
    return conn.submit(
        Submit(conn.next_request_id(), model, SamplingParams(max_tokens=max_tokens), prompt="x")
    )


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_many_concurrent_streams(kind: str, loop_kind: str) -> None:
    """20 requests of 300 tokens each (more than one credit window of 256) all arrive in order."""

    async def body() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            worker = EchoWorker()
            srv = await serve(listen_url(kind, tmp), worker, identity="w0")
            assert srv.address.startswith(f"{kind}://")
            conn = await connect(srv.address, identity="gw")
            assert conn.peer_hello.models == ("tiny",) and conn.peer_hello.identity == "w0"
            streams = [submit(conn, 300) for _ in range(20)]
            results = await asyncio.gather(*(collect(s) for s in streams))
            for events in results:
                assert tokens_of(events) == list(range(300))
                text = b"".join(e.text for e in events if isinstance(e, TokenEntry))
                assert text == b"".join(f"t{i}".encode() for i in range(300))
                assert isinstance(events[-1], Finish) and events[-1].completion_tokens == 300
                assert sum(isinstance(e, (Finish, Error)) for e in events) == 1
            assert conn.in_flight == 0
            await conn.close()
            assert conn.closed
            await srv.close()

    run(loop_kind, body)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_whole_results_arrive_in_one_piece_beside_streamed_ones(loop_kind: str) -> None:
    """Submit.buffered over a real socket (transport.hold on both sides): 600 tokens, beyond the
    256-token window, in one entry right before the end; a streamed request beside it is
    unaffected; a collecting consumer wakes once."""

    async def body() -> None:
        worker = EchoWorker()
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        whole = [conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=600), prompt="x",
                                    buffered=True)) for _ in range(3)]
        streamed = submit(conn, 300)
        events = await collect(whole[0])
        assert [type(e) for e in events] == [TokenEntry, Finish]
        assert tokens_of(events) == list(range(600))
        res = await whole[1].collect()
        assert res.tokens == 600 and res.text == b"".join(f"t{i}".encode() for i in range(600))
        assert isinstance(res.final, Finish)
        assert tokens_of(await collect(streamed)) == list(range(300))
        assert tokens_of(await collect(whole[2])) == list(range(600))
        assert conn.in_flight == 0
        await conn.close()
        await srv.close()

    run(loop_kind, body)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_cancel_reaches_worker_and_ends_once(loop_kind: str) -> None:
    async def body() -> None:
        worker = EchoWorker(step_delay=0.001)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        st = submit(conn, 10**6)
        first = await st.next_events()
        assert isinstance(first[0], TokenEntry)
        st.cancel()
        st.cancel()
        rest = await collect(st)
        assert isinstance(rest[-1], Error) and rest[-1].code == ErrorCode.CANCELLED
        with pytest.raises(StopAsyncIteration):
            await st.next_events()
        for _ in range(100):
            if worker.cancelled:
                break
            await asyncio.sleep(0.01)
        assert worker.cancelled == [st.request_id]
        # The worker's late Finish(CANCELLED) was swallowed; the connection is still fine.
        assert tokens_of(await collect(submit(conn, 5))) == [0, 1, 2, 3, 4]
        assert conn.in_flight == 0
        await conn.close()
        await srv.close()

    run(loop_kind, body)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_submit_the_worker_cannot_decode_fails_alone(loop_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway whose SUBMIT encoding the worker does not accept (version skew, an encoder bug): that
    request ends with INVALID_REQUEST; the one streaming beside it and the connection carry on."""
    import msgpack

    import transport.wire

    real_body = transport.wire.submit_body

    def skewed_body(s: Submit) -> bytes:
        return msgpack.packb(["tiny", "params from another version"]) if s.prompt == "skewed" else real_body(s)

    monkeypatch.setattr(transport.wire, "submit_body", skewed_body)

    async def body() -> None:
        worker = EchoWorker(step_delay=0.001)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        running = submit(conn, 50)
        await running.next_events()
        bad = conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=5), prompt="skewed"))
        (err,) = await collect(bad)
        assert isinstance(err, Error) and err.code == ErrorCode.INVALID_REQUEST and "SUBMIT" in err.message
        assert tokens_of(await collect(running))[-1] == 49
        assert tokens_of(await collect(submit(conn, 3))) == [0, 1, 2]
        assert not conn.closed and conn.in_flight == 0 and len(srv.connections) == 1
        assert worker.disconnected == [] and bad.request_id not in worker.ended
        await conn.close()
        await srv.close()

    run(loop_kind, body)


def test_unknown_model_and_worker_going_away() -> None:
    async def body() -> None:
        worker = EchoWorker(step_delay=0.002)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        bad = await collect(submit(conn, 3, model="nope"))
        assert isinstance(bad[-1], Error) and bad[-1].code == ErrorCode.UNKNOWN_MODEL
        streams = [submit(conn, 10**6) for _ in range(5)]
        await streams[0].next_events()
        await srv.close()  # the worker dies mid-stream
        for s in streams:
            events = await collect(s)
            assert isinstance(events[-1], Error) and events[-1].code == ErrorCode.CONNECTION_LOST
            assert sum(isinstance(e, (Finish, Error)) for e in events) == 1
        await conn.wait_closed()
        assert conn.closed
        with pytest.raises(ConnectionClosed):
            submit(conn, 1)

    run("asyncio", body)


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_slow_consumer_bounded_memory(kind: str) -> None:
    """A consumer that does not drain holds at most one credit window; the worker stalls."""

    async def body() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            worker = EchoWorker()
            srv = await serve(listen_url(kind, tmp), worker)
            conn = await connect(srv.address, initial_credit=16)
            st = submit(conn, 100)
            for _ in range(500):  # do not drain; wait until the worker hits the credit wall
                if worker.stalled_on_credit:
                    break
                await asyncio.sleep(0.01)
            assert worker.stalled_on_credit > 0
            first = await st.next_events()
            assert len(tokens_of(first)) == 16  # everything buffered = exactly one window
            rest = await collect(st)
            assert tokens_of(first + rest) == list(range(100))
            await conn.close()
            await srv.close()

    run("asyncio", body)


def test_dead_peer_detected_over_real_socket() -> None:
    """A 'worker' that says HELLO and then hangs (never answers PINGs) is declared dead."""

    async def body() -> None:
        async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(FrameEncoder().encode(Hello(role="worker", models=("tiny",))))
            await writer.drain()
            await asyncio.sleep(30)

        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = await connect(f"tcp://127.0.0.1:{port}", heartbeat_interval=0.1, dead_after=0.5)
        st = submit(conn, 5)
        t0 = time.monotonic()
        events = await collect(st)
        elapsed = time.monotonic() - t0
        assert isinstance(events[-1], Error) and events[-1].code == ErrorCode.CONNECTION_LOST
        assert "dead" in events[-1].message
        assert 0.3 <= elapsed <= 1.5
        server.close()

    run("asyncio", body)


def test_connect_errors_are_clear() -> None:
    async def body() -> None:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        with pytest.raises(ConnectError):
            await connect(f"tcp://127.0.0.1:{port}", timeout=2)

        async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(5)

        srv = await asyncio.start_server(http, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        with pytest.raises(ProtocolError, match="version"):
            await connect(f"tcp://127.0.0.1:{port}", timeout=2)

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(5)

        srv2 = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = srv2.sockets[0].getsockname()[1]
        with pytest.raises(ConnectError, match="HELLO"):
            await connect(f"tcp://127.0.0.1:{port}", timeout=0.3)
        srv.close()
        srv2.close()

    run("asyncio", body)


def test_rdma_url_falls_back_to_tcp_end_to_end(caplog: pytest.LogCaptureFixture) -> None:
    from transport.rdma import list_devices

    if any(d.active for d in list_devices()):
        pytest.skip("machine has an RDMA device")

    async def body() -> None:
        srv = await serve("rdma://127.0.0.1:0", EchoWorker())
        assert srv.address.startswith("tcp://127.0.0.1:")
        port = srv.address.rsplit(":", 1)[1]
        conn = await connect(f"rdma://127.0.0.1:{port}")
        assert tokens_of(await collect(submit(conn, 4))) == [0, 1, 2, 3]
        await conn.close()
        await srv.close()

    run("asyncio", body)
    assert sum("falling back to tcp" in r.getMessage() for r in caplog.records) == 2  # serve + connect


def test_worker_drain_sends_goodbye_and_finishes_in_flight() -> None:
    async def body() -> None:
        worker = EchoWorker(step_delay=0.001)
        srv = await serve("tcp://127.0.0.1:0", worker)
        conn = await connect(srv.address)
        st = submit(conn, 50)
        await st.next_events()
        await srv.drain(timeout=5)
        events = await collect(st)
        assert isinstance(events[-1], Finish)
        assert getattr(conn, "draining", False)
        with pytest.raises(ConnectionClosed):
            submit(conn, 1)
        with pytest.raises(ConnectError):  # a draining worker accepts no new connections
            await connect(srv.address, timeout=2)
        await conn.close()
        await srv.close()

    run("asyncio", body)


def test_unix_socket_path_is_cleaned_up() -> None:
    async def body() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "w.sock"
            srv = await serve(f"unix://{path}", EchoWorker())
            assert path.exists()
            await srv.close()
            assert not path.exists()
            srv = await serve(f"unix://{path}", EchoWorker())  # rebinding works
            await srv.close()

    run("asyncio", body)


def test_struct_header_matches_spec() -> None:
    """The documented header: version, type, flags, request id, length (little-endian)."""
    frame = FrameEncoder().encode(Hello())
    version, ftype, flags, rid, length = struct.unpack_from("<BBHII", frame)
    assert (version, ftype, flags, rid, length) == (1, 1, 0, 0, len(frame) - 12)


def test_peer_that_stops_reading_pauses_our_reading() -> None:
    """A gateway that stops reading: once the worker's write buffer passes high water, the
    worker stops reading that gateway too; when the gateway reads again, it resumes."""

    async def body() -> None:
        from transport.tcp import StreamChannel

        srv = await serve("tcp://127.0.0.1:0", EchoWorker())
        host, port = srv.address[len("tcp://") :].rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small kernel buffers, so
        sock.connect((host, int(port)))  # the worker's own buffer is what fills up
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        enc = FrameEncoder()
        writer.write(enc.encode(Hello(role="gateway", initial_credit=256)))
        for rid in range(1, 301):
            writer.write(enc.encode(Submit(rid, "tiny", SamplingParams(max_tokens=256), prompt="x")))
        await writer.drain()
        for _ in range(300):
            if srv.connections:
                break
            await asyncio.sleep(0.01)
        (conn,) = srv.connections
        sink = conn.endpoint._sink
        assert isinstance(sink, StreamChannel) and sink.transport is not None
        sink.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        for _ in range(300):
            if not sink.transport.is_reading():
                break
            await asyncio.sleep(0.01)
        assert not sink.transport.is_reading()
        for _ in range(1000):  # the gateway reads again
            if sink.transport.is_reading():
                break
            try:
                await asyncio.wait_for(reader.read(1 << 16), 0.05)
            except TimeoutError:
                pass
        assert sink.transport.is_reading()
        writer.close()
        await srv.close()

    run("asyncio", body)


class RaisingWorker(EchoWorker):
    """Test double whose engine rejects prompts containing 'boom' by raising."""

    def on_submit(self, conn, submit):  # type: ignore[no-untyped-def]
        if submit.prompt == "boom":
            raise RuntimeError("engine exploded")
        super().on_submit(conn, submit)


def test_handler_exception_ends_the_request_not_the_connection() -> None:
    async def body() -> None:
        srv = await serve("tcp://127.0.0.1:0", RaisingWorker())
        conn = await connect(srv.address)
        bad = conn.submit(Submit(conn.next_request_id(), "tiny", SamplingParams(max_tokens=3), prompt="boom"))
        events = await collect(bad)
        assert len(events) == 1 and isinstance(events[0], Error)
        assert events[0].code == ErrorCode.INTERNAL and "engine exploded" in events[0].message
        assert tokens_of(await collect(submit(conn, 3))) == [0, 1, 2]
        await conn.close()
        await srv.close()

    run("asyncio", body)


def test_worker_detects_dead_gateway_and_gateway_close() -> None:
    """Worker side: a silent gateway is declared dead within dead_after; a closing gateway's
    open requests are handed to on_disconnect (so the engine can drop them)."""

    async def body() -> None:
        worker = EchoWorker(step_delay=0.01)
        srv = await serve("tcp://127.0.0.1:0", worker, heartbeat_interval=0.1, dead_after=0.5)
        host, port = srv.address[len("tcp://") :].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        enc = FrameEncoder()
        writer.write(enc.encode(Hello(role="gateway", initial_credit=4)))
        writer.write(enc.encode(Submit(1, "tiny", SamplingParams(max_tokens=100), prompt="x")))
        await writer.drain()
        t0 = time.monotonic()
        while not worker.disconnected and time.monotonic() - t0 < 3:
            await asyncio.sleep(0.02)
        assert worker.disconnected == [(1,)]
        assert 0.3 <= time.monotonic() - t0 <= 1.5
        writer.close()

        conn = await connect(srv.address)
        streams = [submit(conn, 10**6) for _ in range(3)]
        await streams[0].next_events()
        await conn.close()
        for _ in range(100):
            if len(worker.disconnected) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(worker.disconnected[1]) == [s.request_id for s in streams]
        await srv.close()

    run("asyncio", body)
