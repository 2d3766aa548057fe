"""The bench's HTTP/2 client against a strict little h2 server: two streams at a time and a
1,000-byte receive window, so requests must wait for a stream and bodies for window updates.

The server (the ``h2`` library's core on a real socket) answers each request, once its whole
body is in, with a completion whose usage counts the body's bytes as prompt tokens: a body that
lost or doubled a piece would show.
"""

from __future__ import annotations

import asyncio
import time

import orjson
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, RequestReceived, StreamEnded
from h2.settings import SettingCodes, Settings

from gateway.bench.exchange import openai_exchange
from gateway.bench.http2 import HTTP2Sender
from gateway.bench.runner import LoadSpec, Prepared, run_load


class _StrictServer(asyncio.Protocol):
    def __init__(self, seen: list[int]) -> None:
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.bodies: dict[int, bytearray] = {}
        self.open = 0
        self.seen = seen  # the most streams open at once

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.h2.local_settings = Settings(client=False, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: 2, SettingCodes.INITIAL_WINDOW_SIZE: 1000})
        self.h2.initiate_connection()
        self.transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for ev in self.h2.receive_data(data):
            if isinstance(ev, RequestReceived):
                self.bodies[ev.stream_id] = bytearray()
                self.open += 1
                self.seen.append(self.open)
            elif isinstance(ev, DataReceived):
                self.bodies[ev.stream_id] += ev.data
                asyncio.get_running_loop().call_later(0.002, self._ack, ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, StreamEnded):
                body = self.bodies.pop(ev.stream_id)
                doc = orjson.loads(body)
                out = orjson.dumps({"choices": [{"text": "x", "index": 0}],
                                    "usage": {"prompt_tokens": len(body), "completion_tokens": doc["max_tokens"]}})
                self.h2.send_headers(ev.stream_id, [(b":status", b"200"), (b"content-type", b"application/json")])
                self.h2.send_data(ev.stream_id, out, end_stream=True)
                self.open -= 1
        self.transport.write(self.h2.data_to_send())

    def _ack(self, n: int, sid: int) -> None:
        if sid in self.bodies:
            self.h2.acknowledge_received_data(n, sid)  # a window update once half the window was read
            self.transport.write(self.h2.data_to_send())


async def test_requests_wait_for_streams_and_bodies_for_the_window() -> None:
    seen: list[int] = []
    server = await asyncio.get_running_loop().create_server(lambda: _StrictServer(seen), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sender = HTTP2Sender(f"http://127.0.0.1:{port}", openai_exchange("completions", stream=False), connections=1,
                         timeout=10, now=time.perf_counter)
    bodies = [orjson.dumps({"model": "m", "prompt": "p" * n, "max_tokens": 3}) for n in (10, 5_000, 40_000)]
    try:
        out = await run_load(sender, [Prepared(b, 0, 3) for b in bodies], LoadSpec(concurrency=6, num_requests=12))
    finally:
        await sender.close()
        server.close()
    assert [r.error for r in out.records] == [""] * 12
    assert sorted(r.prompt_tokens for r in out.records) == sorted(len(b) for b in bodies * 4)
    assert max(seen) == 2 and out.max_in_flight == 6  # six asked at once, two streams open at a time
