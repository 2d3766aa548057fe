"""The sender for ``--protocol``, and request bodies rendered for it."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Sequence

from .bodies import ENDPOINTS, BodyOptions, grpc_body, openai_body
from .data import BenchRequest
from .runner import Prepared, Sender

__all__ = ["make_sender", "prepare_all", "tls_context"]


def tls_context(*, insecure: bool, cacert: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cacert)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def make_sender(protocol: str, url: str, *, endpoint: str, stream: bool, api_key: str = "",
                timeout: float = 600.0, insecure: bool = False, cacert: str | None = None,
                concurrency_hint: int = 64, now: Callable[[], float] = time.perf_counter) -> Sender:
    path = ENDPOINTS[endpoint]
    ctx = tls_context(insecure=insecure, cacert=cacert) if url.startswith("https:") else None
    if protocol == "http1":
        from .http1 import HTTP1Sender

        return HTTP1Sender(url, path=path, stream=stream, api_key=api_key, timeout=timeout, ssl_context=ctx,
                           now=now)
    if protocol == "h2":
        from .http2 import HTTP2Sender

        conns = max(1, min(8, concurrency_hint // 64 + 1))
        return HTTP2Sender(url, path=path, stream=stream, api_key=api_key, timeout=timeout, ssl_context=ctx,
                           connections=conns, now=now)
    if protocol == "grpc":
        from .grpc_native import GRPCSender

        ca = open(cacert, "rb").read() if cacert else None
        return GRPCSender(url, stream=stream, api_key=api_key, timeout=timeout, ca_pem=ca, now=now)
    raise ValueError(f"unknown protocol {protocol!r}")


def prepare_all(sender: Sender, protocol: str, requests: Sequence[BenchRequest], o: BodyOptions) -> list[Prepared]:
    render = grpc_body if protocol == "grpc" else openai_body
    return [Prepared(sender.prepare(render(r, o)), r.prompt_len, r.output_len) for r in requests]
