"""Log output: plain text or one JSON object per line, and the access log.

Why JSON: log pipelines (journald -> Loki, Kubernetes -> Elasticsearch) index
fields, so a request's id, trace id, model, status and timings must be fields,
not words in a sentence. Any record may carry them: pass
``extra={"fields": {...}}``; the JSON formatter merges them into the object, the
text formatter appends them as ``key=value``. :func:`access_log` writes the one
line per finished request on the ``quicserve.access`` logger (silence it with
that logger's level); it is called by the request pipeline's end-of-request hook
with explicit arguments, so it costs nothing the pipeline does not already know.

:func:`configure_logging` also exports the level and format as ``$QUICSERVE_LOG``
and ``$QUICSERVE_LOG_FORMAT``, which local workers -- child processes writing to
the same stderr -- inherit and read at start-up: one setting governs the whole
service, and a JSON log stays JSON when a worker's lines join it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

from transport.common.logfmt import JsonFormatter, TextFormatter, install

__all__ = ["ACCESS_LOGGER", "JsonFormatter", "TextFormatter", "access_log", "access_record",
           "configure_logging"]  # the formatters live in transport.common.logfmt, shared with the workers

ACCESS_LOGGER = "quicserve.access"


def configure_logging(level: str, fmt: str = "text", *, stream: TextIO | None = None,
                      environ: MutableMapping[str, str] | None = None) -> logging.Handler:
    """Root handler with the chosen formatter; the level and format are exported to child workers."""
    env = os.environ if environ is None else environ
    env["QUICSERVE_LOG"] = level.upper()
    env["QUICSERVE_LOG_FORMAT"] = fmt
    return install(level, fmt, stream if stream is not None else sys.stderr)


def access_record(*, method: str, path: str, protocol: str, status: int, duration_s: float,
                  request_id: str = "", trace_id: str = "", model: str = "", peer: str = "",
                  ttft_s: float | None = None, prompt_tokens: int | None = None,
                  completion_tokens: int | None = None, error: str = "", route: str = "") -> dict[str, Any]:
    """The access log's fields for one request (empty strings and Nones left out). Pure."""
    rec: dict[str, Any] = {"method": method, "path": path, "protocol": protocol, "status": status,
                           "duration_ms": round(duration_s * 1e3, 3)}
    if ttft_s is not None:
        rec["ttft_ms"] = round(ttft_s * 1e3, 3)
    for k, v in (("request_id", request_id), ("trace_id", trace_id), ("model", model), ("peer", peer),
                 ("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens), ("error", error),
                 ("route", route)):
        if v is not None and v != "":
            rec[k] = v
    return rec


_access = logging.getLogger(ACCESS_LOGGER)


def access_log(*, method: str, path: str, protocol: str, status: int, duration_s: float,
               request_id: str = "", trace_id: str = "", model: str = "", peer: str = "",
               ttft_s: float | None = None, prompt_tokens: int | None = None,
               completion_tokens: int | None = None, error: str = "", route: str = "") -> None:
    """One line per finished request: ``METHOD path protocol status`` plus the fields of :func:`access_record`."""
    if not _access.isEnabledFor(logging.INFO):  # access log off: not even the dict is built
        return
    fields = access_record(method=method, path=path, protocol=protocol, status=status, duration_s=duration_s,
                           request_id=request_id, trace_id=trace_id, model=model, peer=peer, ttft_s=ttft_s,
                           prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, error=error, route=route)
    _access.info("%s %s %s %d", method, path, protocol, status, extra={"fields": fields})
