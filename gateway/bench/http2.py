"""The HTTP/2 client: httpx with h2, over TLS (ALPN) or cleartext with prior knowledge (h2c).

Requests are multiplexed on httpx's HTTP/2 connection(s) to the server; each piece of a
streamed body that httpx hands over is time-stamped as it arrives.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

import httpx

from .records import Record, SSEReader, read_whole_response

__all__ = ["HTTP2Sender"]


class HTTP2Sender:
    """OpenAI requests over HTTP/2: ``https://`` negotiates h2 by ALPN, ``http://`` is h2c."""

    def __init__(self, url: str, *, path: str, stream: bool, api_key: str = "", timeout: float = 600.0,
                 ssl_context: ssl.SSLContext | None = None, connections: int = 4,
                 now: Callable[[], float]) -> None:
        self.url = url.rstrip("/") + path
        self.stream, self.now = stream, now
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        if stream:
            self.headers["accept"] = "text/event-stream"
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = httpx.AsyncClient(http1=False, http2=True, verify=ssl_context or True, limits=limits,
                                        timeout=httpx.Timeout(timeout))
        self.timeout = timeout

    def prepare(self, body: bytes) -> bytes:
        return body

    async def send(self, payload: bytes, rec: Record) -> None:
        try:
            async with self.client.stream("POST", self.url, content=payload, headers=self.headers) as resp:
                if resp.status_code != 200:
                    body = await resp.aread()
                    rec.end = self.now()
                    rec.fail(f"http_{resp.status_code}", body[:300].decode(errors="replace"))
                elif self.stream:
                    sse = SSEReader(rec)
                    async for chunk in resp.aiter_raw():
                        sse.feed(chunk, self.now())
                    sse.finish(self.now())
                else:
                    read_whole_response(await resp.aread(), rec, self.now())
        except httpx.TimeoutException:
            rec.fail("timeout", f"no complete response in {self.timeout:g} s")
        except (httpx.TransportError, OSError) as e:
            rec.fail("connection", str(e) or type(e).__name__)
        if rec.error and not rec.end:
            rec.end = self.now()

    async def close(self) -> None:
        await self.client.aclose()
