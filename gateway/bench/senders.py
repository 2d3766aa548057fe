"""The sender for ``--protocol``, and request bodies rendered for it."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Sequence

from .bodies import BodyOptions, grpc_body, openai_body
from .data import BenchRequest
from .exchange import Exchange, grpc_web_exchange, openai_exchange
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
                concurrency_hint: int = 64, over: str = "http1",
                now: Callable[[], float] = time.perf_counter) -> Sender:
    """``protocol``: http1, h2, h3 (OpenAI's API), grpc (native) or grpc-web (over ``over``)."""
    if protocol == "grpc":
        from .grpc_native import GRPCSender

        ca = open(cacert, "rb").read() if cacert else None
        return GRPCSender(url, stream=stream, api_key=api_key, timeout=timeout, ca_pem=ca, now=now)
    if protocol == "grpc-web":
        exchange, protocol = grpc_web_exchange(stream=stream, api_key=api_key), over
    else:
        exchange = openai_exchange(endpoint, stream=stream, api_key=api_key)
    return _http_sender(protocol, url, exchange, timeout=timeout, insecure=insecure, cacert=cacert,
                        concurrency_hint=concurrency_hint, now=now)


def _http_sender(version: str, url: str, exchange: Exchange, *, timeout: float, insecure: bool,
                 cacert: str | None, concurrency_hint: int, now: Callable[[], float]) -> Sender:
    conns = max(1, min(8, concurrency_hint // 64 + 1))
    if version == "h3":
        from .http3 import HTTP3Sender

        return HTTP3Sender(url, exchange, timeout=timeout, insecure=insecure, cacert=cacert, connections=conns,
                           now=now)
    ctx = tls_context(insecure=insecure, cacert=cacert) if url.startswith("https:") else None
    if version == "http1":
        from .http1 import HTTP1Sender

        return HTTP1Sender(url, exchange, timeout=timeout, ssl_context=ctx, now=now)
    if version == "h2":
        from .http2 import HTTP2Sender

        return HTTP2Sender(url, exchange, timeout=timeout, ssl_context=ctx, connections=conns, now=now)
    raise ValueError(f"unknown protocol {version!r}")


def _grpc_web_body(r: BenchRequest, o: BodyOptions) -> bytes:
    from .grpc_web import frame_body

    return frame_body(grpc_body(r, o))


_RENDER: dict[str, Callable[[BenchRequest, BodyOptions], bytes]] = {"grpc": grpc_body, "grpc-web": _grpc_web_body}


def prepare_all(sender: Sender, protocol: str, requests: Sequence[BenchRequest], o: BodyOptions) -> list[Prepared]:
    render = _RENDER.get(protocol, openai_body)
    return [Prepared(sender.prepare(render(r, o)), r.prompt_len, r.output_len) for r in requests]
