"""The result file: the environment, the arguments, and each run's figures and every record.

One JSON document (``quicserve_bench`` is its format version); ``runs`` holds one entry per
request rate of a sweep (or the one closed-loop or trace run), each with its ``summary``
(:func:`gateway.bench.stats.summarize`), the client's own cost and every per-request record.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from .records import Record

__all__ = ["environment", "result_doc", "write_result", "load_result", "run_records", "FORMAT"]

FORMAT = 1


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, object]:
    return {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "platform": platform.platform(), "machine": platform.machine(), "hostname": socket.gethostname(),
            "cpus": os.cpu_count(), "quicserve": _version("quicserve"), "aioquic": _version("aioquic"),
            "h2": _version("h2"), "grpcio": _version("grpcio"), "argv": sys.argv}


def result_doc(args: dict[str, object], runs: list[dict[str, object]], label: str) -> dict[str, object]:
    return {"quicserve_bench": FORMAT, "label": label,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": environment(),
            "args": args, "runs": runs}


def write_result(path: str | Path, doc: dict[str, object]) -> None:
    Path(path).write_bytes(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY))


def load_result(path: str | Path) -> dict[str, Any]:
    doc = orjson.loads(Path(path).read_bytes())
    if not isinstance(doc, dict) or doc.get("quicserve_bench") != FORMAT:
        raise ValueError(f"{path}: not a quicserve bench result (format {FORMAT})")
    return doc


def run_records(run: dict[str, Any]) -> list[Record]:
    return [Record.from_json(d) for d in run["records"]]
