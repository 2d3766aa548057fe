"""A scripted OpenAI-compatible HTTP/1.1 server for the bench's tests, on a clock it moves itself
(and the same script as quicserve's gRPC-Web ``Generate`` / ``Complete``).

How it works: the server and the client under test share a :class:`ScriptClock`. For each
request the server plays its script: before it writes a piece of the response it sets the
clock to the request's arrival plus that piece's time, then lets the real loop turn (a few
ms) so the client reads the piece before the next one is written. The client reads the same
clock, so it sees exactly the gaps of the script, whatever the machine's load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

__all__ = ["ScriptClock", "Script", "ScriptedServer", "start_scripted"]


class ScriptClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Script:
    """Token times in ms after the request arrived, the end's time, and what else to do."""

    token_ms: Sequence[float] = (50, 70, 100, 140, 150)
    end_ms: float = 160
    status: int = 200
    usage: bool = True
    done: bool = True  # send data: [DONE]
    cut: bool = False  # close the connection before the end
    hang: bool = False  # never answer
    grpc_status: int = 0  # gRPC-Web: the status in the trailer frame (done=False: no trailer frame)
    seen: list[bytes] = field(default_factory=list)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _event(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class _Conn(asyncio.Protocol):
    def __init__(self, server: ScriptedServer) -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buf[:head_end].decode().lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        if len(self.buf) < head_end + 4 + length:
            return
        body = self.buf[head_end + 4: head_end + 4 + length]
        self.buf = self.buf[head_end + 4 + length:]
        loop = asyncio.get_running_loop()
        if "content-type: application/grpc-web" in head:
            loop.create_task(self.play_web(head.split(" ", 2)[1].endswith("/generate"), body))
        else:
            loop.create_task(self.play(orjson.loads(body)))

    async def play(self, req: dict[str, object]) -> None:
        s, clock, tr = self.server.script, self.server.clock, self.transport
        assert tr is not None
        s.seen.append(orjson.dumps(req))
        base = clock.t
        if s.hang:
            return
        if s.status != 200:
            await self.refuse(base)
            return
        chat = "messages" in req
        if not req.get("stream"):
            await self.server.at(base, s.end_ms)
            text = "x" * len(s.token_ms)
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            body = orjson.dumps({"choices": [choice | {"index": 0, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 7, "completion_tokens": len(s.token_ms)}})
            tr.write(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                     .encode() + body)
            return
        tr.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        tr.write(_chunk(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]} if chat else
                               {"choices": [{"index": 0, "text": ""}]})))  # a first chunk with no text
        for i, ms in enumerate(s.token_ms):
            await self.server.at(base, ms)
            if s.cut and i == len(s.token_ms) // 2:
                tr.close()
                return
            piece = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
            tr.write(_chunk(_event({"choices": [piece | {"index": 0, "finish_reason": None}]})))
        await self.server.at(base, s.end_ms)
        tail = _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(s.token_ms)}}) \
            if s.usage else b""
        tail += b"data: [DONE]\n\n" if s.done else b""
        tr.write(_chunk(tail) + b"0\r\n\r\n")

    async def refuse(self, base: float) -> None:
        s, tr = self.server.script, self.transport
        assert tr is not None
        await self.server.at(base, s.end_ms)
        body = orjson.dumps({"error": {"message": "scripted refusal", "type": "overloaded"}})
        tr.write(f"HTTP/1.1 {s.status} Nope\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(body)}\r\n\r\n".encode() + body)

    async def play_web(self, stream: bool, body: bytes) -> None:
        """The same script as gRPC-Web: a message a token (Generate) or one message (Complete)."""
        from gateway.grpc.framing import FLAG_TRAILERS, encode_frame
        from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb

        s, clock, tr = self.server.script, self.server.clock, self.transport
        assert tr is not None
        s.seen.append(body)
        base = clock.t
        if s.status != 200:
            await self.refuse(base)
            return
        usage = pb.Usage(prompt_tokens=7, completion_tokens=len(s.token_ms))
        tr.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc-web+proto\r\ntransfer-encoding: chunked\r\n\r\n")
        if stream:
            for i, ms in enumerate(s.token_ms):
                await self.server.at(base, ms)
                tr.write(_chunk(encode_frame(0, pb.GenerateResponse(text=f"t{i}").SerializeToString())))
            last = pb.GenerateResponse(usage=usage)
        else:
            last = pb.GenerateResponse(text="x" * len(s.token_ms), usage=usage)
        await self.server.at(base, s.end_ms)
        tail = encode_frame(0, last.SerializeToString()) if not s.grpc_status else b""
        if s.done:
            tail += encode_frame(FLAG_TRAILERS, f"grpc-status:{s.grpc_status}\r\ngrpc-message:scripted%20refusal\r\n"
                                 .encode())
        tr.write(_chunk(tail) + b"0\r\n\r\n")


class ScriptedServer:
    def __init__(self, script: Script, clock: ScriptClock) -> None:
        self.script, self.clock = script, clock
        self.server: asyncio.Server | None = None
        self.port = 0

    async def at(self, base: float, ms: float) -> None:
        """Let the client read what was written, then move the clock to ``base + ms``."""
        await asyncio.sleep(0.004)
        self.clock.t = base + ms / 1e3

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def start_scripted(script: Script, clock: ScriptClock) -> ScriptedServer:
    srv = ScriptedServer(script, clock)
    srv.server = await asyncio.get_running_loop().create_server(lambda: _Conn(srv), "127.0.0.1", 0)
    srv.port = srv.server.sockets[0].getsockname()[1]
    return srv
