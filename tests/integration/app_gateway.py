"""The in-process gateway the integration tests over real sockets share: the real :class:`App`
(pipeline, admission when given) on real HTTP listeners on 127.0.0.1 port 0, with a scripted worker
double in place of a worker process. Real-process tests start ``quicserve serve`` instead
(tests/integration/test_gateway_e2e.py ``start_gateway``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from gateway.admission.config import AdmissionSettings
from gateway.admission.setup import build_admission
from gateway.app import App
from gateway.http.server import HttpLimits, HttpServer, start_server
from gateway.http.tls import load_or_create_tls
from gateway.routing.pool import ModelPool
from tests.gateway.doubles import ScriptedWorkerConnection

__all__ = ["AppGateway", "app_gateway"]


@dataclass
class AppGateway:
    app: App
    conn: ScriptedWorkerConnection
    server: HttpServer  # cleartext HTTP/1.1 + h2c
    tls: HttpServer | None  # TLS (h2, HTTP/1.1) when asked for

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    http = url

    @property
    def https(self) -> str:
        assert self.tls is not None, "started without tls_dir"
        return f"https://127.0.0.1:{self.tls.port}"


@asynccontextmanager
async def app_gateway(conn: ScriptedWorkerConnection | None = None, *, limits: HttpLimits | None = None,
                      admission: AdmissionSettings | None = None, tls_dir: Path | None = None
                      ) -> AsyncIterator[AppGateway]:
    """An :class:`AppGateway`; ``admission``: the stage built as ``serve`` builds it (with its schema
    registry); ``tls_dir``: also a TLS listener with a self-signed certificate kept there."""
    conn = conn if conn is not None else ScriptedWorkerConnection(tokens_per_batch=1)
    pool = ModelPool()
    pool.add(conn)
    if admission is not None:
        parts = build_admission(admission, "127.0.0.1")
        assert parts.schemas is not None
        app = App(pool, admission=parts.stage, validate=parts.schemas.validate)
    else:
        app = App(pool)
    server = await start_server(app.handle, host="127.0.0.1", port=0, limits=limits, on_event=app.on_http_event)
    tls = None
    try:
        if tls_dir is not None:
            ctx, _ = load_or_create_tls(None, None, tls_dir)
            tls = await start_server(app.handle, host="127.0.0.1", port=0, ssl_context=ctx, limits=limits,
                                     on_event=app.on_http_event)
        yield AppGateway(app, conn, server, tls)
    finally:
        await server.close()
        if tls is not None:
            await tls.close()
