"""gRPC in the gateway process: the service bound to the pipeline, on its own port and as
gRPC-Web on the HTTP listeners (the app's mounted routes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..http.common import task_entrance
from .compression import Codecs
from .config import GrpcSettings
from .grpc_web_route import GrpcWebRoute
from .native_server import NativeServer, start_native
from .pipeline_backend import PipelineBackend
from .service import InferenceService

if TYPE_CHECKING:
    from ..app import App

__all__ = ["mount_grpc"]


async def mount_grpc(app: App, settings: GrpcSettings, host: str) -> NativeServer | None:
    """Mount gRPC-Web on ``app`` (if enabled) and start native gRPC (if its port is not -1)."""
    backend = PipelineBackend(app.pool, app.generations, app.openai, keys=app.keys)
    codecs = Codecs(settings.zstd_level, settings.gzip_level, settings.compress_min_bytes)
    if settings.web:
        handlers = InferenceService(backend).__mapping__()
        origins = [o.encode() for o in settings.allowed_origins] or None
        route = GrpcWebRoute(handlers, codecs, settings.max_message_bytes, origins,
                             write_timeout=app.api_settings.write_timeout)
        app.mount(handlers, task_entrance(route), route.streams_body)
    if settings.port < 0:
        return None
    return await start_native(backend, settings.host or host, settings.port, codecs=codecs,
                              max_message=settings.max_message_bytes, write_timeout=app.api_settings.write_timeout)
