"""Run the app's tests over real HTTP/1.1 and HTTP/2 listeners as well as at the entrance.

``Via`` serves an :class:`~gateway.app.App` on a loopback listener (started once per app) and
sends a :class:`~gateway.http.types.Request` with httpx, over HTTP/1.1 or HTTP/2 (h2c, prior
knowledge). The answer comes back as a :class:`WireResponse`, which reads like the
``RecordingSink`` a test gets at the entrance (``status``, ``headers``, ``body``, ``streamed``,
``json()``, ``header()``), so one test body checks all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from gateway.app import App
from gateway.http.server import start_server
from gateway.http.types import Request

from .doubles import ResponseView

__all__ = ["PROTOCOLS", "Via", "WireResponse"]

PROTOCOLS = ("entrance", "http/1.1", "h2")


@dataclass
class WireResponse(ResponseView):
    status: int
    headers: list[tuple[bytes, bytes]]
    chunks: list[bytes]
    protocol: str
    ended: bool = True
    aborted: bool = False

    @property
    def streamed(self) -> bool:
        """A response of unknown length: chunked in HTTP/1.1, no content-length in HTTP/2."""
        if self.protocol == "http/1.1":
            return self.header(b"transfer-encoding") == b"chunked"
        return self.header(b"content-length") is None



@dataclass
class Via:
    """The protocol a test runs over, and its servers and clients (closed by :meth:`close`)."""

    protocol: str
    _served: dict[int, tuple[object, httpx.AsyncClient, str]] = field(default_factory=dict)

    async def send(self, app: App, r: Request) -> WireResponse:
        listener, client, base = await self._serve(app)
        url = base + r.path + (f"?{r.query}" if r.query else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in r.headers]
        async with client.stream(r.method, url, headers=headers, content=r.body or None) as resp:
            chunks = [c async for c in resp.aiter_raw()]
            want = "HTTP/1.1" if self.protocol == "http/1.1" else "HTTP/2"
            assert resp.http_version == want, resp.http_version
            raw = [(k.lower(), v) for k, v in resp.headers.raw]
            return WireResponse(resp.status_code, raw, chunks, self.protocol)

    async def _serve(self, app: App) -> tuple[object, httpx.AsyncClient, str]:
        got = self._served.get(id(app))
        if got is None:
            listener = await start_server(app.handle, host="127.0.0.1", port=0, on_event=app.on_http_event)
            h2 = self.protocol == "h2"
            client = httpx.AsyncClient(http1=not h2, http2=h2, timeout=30)
            got = self._served[id(app)] = (listener, client, f"http://127.0.0.1:{listener.port}")
        return got

    async def close(self) -> None:
        for listener, client, _ in self._served.values():
            await client.aclose()
            await listener.close()  # type: ignore[attr-defined]
        self._served.clear()
