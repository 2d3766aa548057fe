"""A small raw HTTP/2 client for tests (h2c with prior knowledge, over asyncio): frames in, events
out, so a test decides exactly when each HEADERS, DATA and RST_STREAM leaves and sees what
arrives in between (full duplex, flow control, trailers)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

import h2.config
import h2.connection
import h2.events
import h2.settings
from hyperframe.frame import GoAwayFrame

__all__ = ["RawH2"]


class RawH2:
    """``async with RawH2(port) as c:`` then ``c.request(...)``, ``c.data(...)``, ``await c.until(...)``."""

    def __init__(self, port: int, host: str = "127.0.0.1", window: int | None = None, ack: bool = True) -> None:
        self._addr = (host, port)
        self._window = window  # our INITIAL_WINDOW_SIZE (None: h2's default, 65535)
        self._ack = ack  # hand the window back as DATA arrives (False: a client that never reads)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.events: list[h2.events.Event] = []
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    async def __aenter__(self) -> RawH2:
        self._reader, self._writer = await asyncio.open_connection(*self._addr)
        self.conn.initiate_connection()
        if self._window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self._window})
        self._flush()
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._writer is not None:
            self._writer.close()

    def _flush(self) -> None:
        assert self._writer is not None
        data = self.conn.data_to_send()
        if data:
            self._writer.write(data)

    async def _read(self) -> None:
        assert self._reader is not None
        while data := await self._reader.read(65536):
            events = self.conn.receive_data(data)
            for ev in events:
                if isinstance(ev, h2.events.DataReceived) and self._ack:  # the test reads at once: hand the window back
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            self.events.extend(events)
            self._flush()
            self._changed.set()
        self.closed = True
        self._changed.set()

    def request(self, path: str, headers: list[tuple[bytes, bytes]], end: bool = False) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                                     (b":authority", b"localhost"), *headers], end_stream=end)
        self._flush()
        return sid

    def data(self, sid: int, data: bytes, end: bool = False) -> None:
        """DATA frames of at most the peer's frame size (the windows must allow ``data``)."""
        step = self.conn.max_outbound_frame_size
        pieces = [data[i:i + step] for i in range(0, len(data), step)] or [b""]
        for i, piece in enumerate(pieces):
            self.conn.send_data(sid, piece, end_stream=end and i == len(pieces) - 1)
        self._flush()

    def end(self, sid: int) -> None:
        self.conn.end_stream(sid)
        self._flush()

    def reset(self, sid: int) -> None:
        self.conn.reset_stream(sid)
        self._flush()

    def goaway(self, last_stream_id: int = 0, error_code: int = 0) -> None:
        """A GOAWAY frame, built by hand: h2 would stop our own side from receiving after it."""
        assert self._writer is not None
        self._writer.write(GoAwayFrame(0, last_stream_id=last_stream_id, error_code=error_code).serialize())

    def raw(self, data: bytes) -> None:
        """Bytes as they are (frames built by hand: what h2 would not let us send)."""
        assert self._writer is not None
        self._writer.write(data)

    def window(self, sid: int) -> int:
        """What we may still send on ``sid`` (the smaller of its and the connection's windows)."""
        return self.conn.local_flow_control_window(sid)

    def body(self, sid: int) -> bytes:
        return b"".join(e.data or b"" for e in self.events
                        if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)

    def headers(self, sid: int) -> list[dict[bytes, bytes]]:
        """Every header block of the stream, in order (response headers, then trailers)."""
        return [dict(e.headers or []) for e in self.events
                if isinstance(e, (h2.events.ResponseReceived, h2.events.TrailersReceived)) and e.stream_id == sid]

    def ended(self, sid: int) -> bool:
        return any(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) and e.stream_id == sid
                   for e in self.events)

    async def until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                if self.closed:
                    raise ConnectionError("the server closed the connection")
                self._changed.clear()
                await self._changed.wait()
