"""The shared log formats: JSON objects with a record's fields merged in, or text with key=value."""

from __future__ import annotations

import logging
import sys

import orjson

from transport.common.logfmt import JsonFormatter, TextFormatter


def _record(msg: str = "hello %s", args: tuple[object, ...] = ("world",), **fields: object) -> logging.LogRecord:
    r = logging.LogRecord("quicserve.x", logging.WARNING, __file__, 1, msg, args, None)
    r.created = 1_700_000_000.25
    if fields:
        r.fields = fields
    return r


def test_json_lines_carry_the_fields() -> None:
    line = JsonFormatter().format(_record(request_id="r-1", status=200, ttft_ms=12.5))
    assert "\n" not in line
    assert orjson.loads(line) == {"ts": "2023-11-14T22:13:20.250000Z", "level": "warning", "logger": "quicserve.x",
                                  "msg": "hello world", "request_id": "r-1", "status": 200, "ttft_ms": 12.5}
    try:
        raise ValueError("boom")
    except ValueError:
        r = _record()
        r.exc_info = sys.exc_info()
    assert "ValueError: boom" in orjson.loads(JsonFormatter().format(r))["exc"]


def test_text_lines_append_key_values() -> None:
    line = TextFormatter().format(_record(model="tiny", error="no worker", ttft_ms=None, took=0.1234567))
    assert line.endswith('WARNING quicserve.x: hello world model=tiny error="no worker" took=0.123457')
    assert TextFormatter().format(_record()).endswith("quicserve.x: hello world")
