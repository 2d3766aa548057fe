"""The log line formats a gateway and its workers share: plain text, or one JSON object per line.

Why here: local workers write to the gateway's stderr, so one service log mixes both
processes' lines and they must come in one format; imports flow ``gateway ->
transport <- inference``, so the formatters sit beside the other launch contract
(:mod:`transport.common.worker_options`). Any record may carry structured fields -- pass
``extra={"fields": {...}}``: JSON merges them into the object, text appends them as
``key=value``. Stdlib and orjson only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, TextIO

import orjson

__all__ = ["FORMATS", "JsonFormatter", "TextFormatter", "install"]

FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _fields(record: logging.LogRecord) -> Mapping[str, Any]:
    f = getattr(record, "fields", None)
    return f if isinstance(f, Mapping) else {}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...fields, "exc"}`` on one line (orjson: no per-record dict copies)."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": _rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        obj.update(_fields(record))
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(obj, default=str).decode()


class TextFormatter(logging.Formatter):
    """The usual ``time LEVEL logger: message`` line, then the record's fields as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items() if v is not None)


def _text_value(v: Any) -> str:
    s = f"{v:.6g}" if isinstance(v, float) else str(v)
    return f'"{s}"' if (" " in s or not s) else s


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def install(level: str, fmt: str, stream: TextIO) -> logging.Handler:
    """Make ``stream`` the root logger's one handler, in format ``fmt`` ("text" or "json") at ``level``."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
