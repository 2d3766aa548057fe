"""The native gRPC client: grpcio's asyncio API on quicserve's ``quicserve.v1.Inference``.

Streamed: ``Generate`` (one message per engine step, the last with usage); not streamed:
``Complete``. Requests are serialized once before the run (the channel sends the bytes as
they are). ``grpc://host:port`` is cleartext h2c, ``grpcs://`` TLS. grpcio is imported only
here (it is the test extra's; ``pip install grpcio`` for this protocol).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

from .records import Record

__all__ = ["GRPCSender"]

_SERVICE = "/quicserve.v1.Inference/"


class GRPCSender:
    """quicserve's own gRPC API (not OpenAI's: a server that is not quicserve does not serve it)."""

    def __init__(self, url: str, *, stream: bool, api_key: str = "", timeout: float = 600.0,
                 ca_pem: bytes | None = None, now: Callable[[], float]) -> None:
        import grpc
        import grpc.aio

        from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb

        self._grpc: Any = grpc
        u = urllib.parse.urlsplit(url)
        target = f"{u.hostname or '127.0.0.1'}:{u.port or 50051}"
        options = [("grpc.max_receive_message_length", 64 << 20)]
        if u.scheme == "grpcs":
            creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
            self.channel: Any = grpc.aio.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        self.stream, self.timeout, self.now = stream, timeout, now
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.generate = self.channel.unary_stream(_SERVICE + "Generate",
                                                  response_deserializer=pb.GenerateResponse.FromString)
        self.complete = self.channel.unary_unary(_SERVICE + "Complete",
                                                 response_deserializer=pb.GenerateResponse.FromString)

    def prepare(self, body: bytes) -> bytes:
        return body

    async def send(self, payload: bytes, rec: Record) -> None:
        try:
            if self.stream:
                chunks = 0
                async for msg in self.generate(payload, timeout=self.timeout, metadata=self.metadata):
                    if msg.text:
                        chunks += 1
                        rec.token_at(self.now())
                    if msg.HasField("usage"):
                        rec.output_tokens = msg.usage.completion_tokens
                        rec.prompt_tokens = msg.usage.prompt_tokens
                rec.end = self.now()
                rec.output_tokens = rec.output_tokens or chunks
            else:
                msg = await self.complete(payload, timeout=self.timeout, metadata=self.metadata)
                rec.end = self.now()
                rec.ttft = rec.end - rec.start
                rec.output_tokens = msg.usage.completion_tokens
                rec.prompt_tokens = msg.usage.prompt_tokens or rec.prompt_tokens
        except self._grpc.aio.AioRpcError as e:
            code = e.code()
            kind = "timeout" if code == self._grpc.StatusCode.DEADLINE_EXCEEDED else f"grpc_{code.name}"
            rec.fail(kind, e.details() or "")
            rec.end = self.now()

    async def close(self) -> None:
        await self.channel.close()

