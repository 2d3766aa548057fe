"""``[observability] metrics_listen``: /metrics on a listener of its own, and only there.

Prometheus scrapes a port that the clients' listeners do not share, so a NetworkPolicy (or a
firewall) can open one to the monitoring namespace and the other to clients; the public
listeners then answer /metrics with 404 like any unknown URL. The listener serves nothing
else (404), plain HTTP/1.1 and h2c, and drains with the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import APIError
from ..http.common import HttpLimits, task_entrance
from ..http.listeners import ListenerSpec, StreamListener, start_listener
from ..http.types import Request, ResponseSink
from .config import ObservabilitySettings, parse_listen

if TYPE_CHECKING:
    from ..app import App

__all__ = ["start_metrics_listener"]

METRICS = "/metrics"


async def start_metrics_listener(app: App, settings: ObservabilitySettings, limits: HttpLimits,
                                 bind: bool = True) -> StreamListener | None:
    """Move ``app``'s /metrics to a listener on ``settings.metrics_listen`` (unset: leave it where it
    is). ``bind``: False in every gateway process of several but the first (one /metrics serves the
    merged figures of all; none of them serves it on the public listeners)."""
    if not settings.metrics_listen:
        return None
    page = app.small.pop(METRICS)["GET"]  # the public listeners: 404, like any unknown URL
    if not bind:
        return None

    async def scrape(req: Request, sink: ResponseSink) -> None:
        if req.path != METRICS:
            raise APIError(404, f"Unknown request URL: {req.method} {req.path}. This listener serves {METRICS} "
                           "only.", "invalid_request_error", None, "unknown_url")
        if req.method not in ("GET", "HEAD"):
            raise APIError(405, f"Method {req.method} is not allowed for {METRICS}; allowed: GET, HEAD.",
                           "invalid_request_error", None, "method_not_allowed", headers=((b"allow", b"GET, HEAD"),))
        sink.respond(*page(req))

    host, port = parse_listen(settings.metrics_listen)
    return await start_listener(task_entrance(scrape), ListenerSpec("tcp", host, port), limits=limits)
