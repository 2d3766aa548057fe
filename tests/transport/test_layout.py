"""The shape of transport/: no import circle of any kind (every import counts: module level, under
``if TYPE_CHECKING:``, inside functions), and transport imports neither gateway nor inference."""

from __future__ import annotations

import graphlib
from functools import partial
from pathlib import Path

from tests.gateway.test_layout import _imports as _gateway_imports

_imports = partial(_gateway_imports, everywhere=True)
TRANSPORT = Path(__file__).resolve().parents[2] / "transport"


def _modules() -> dict[str, Path]:
    out = {}
    for path in TRANSPORT.rglob("*.py"):
        parts = list(path.relative_to(TRANSPORT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def test_no_import_circle_of_any_kind() -> None:
    mods = _modules()
    graph = {name: _imports(name, path, set(mods)) for name, path in mods.items()}
    for m in graph:  # a package's own __init__ is not a circle
        graph[m].discard("transport")
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError("import circle in transport/: " + " -> ".join(reversed(exc.args[1]))) from None


def test_transport_imports_neither_side() -> None:
    bad = []
    for name, path in _modules().items():
        text = path.read_text()
        for side in ("gateway", "inference"):
            if f"from {side}" in text or f"import {side}" in text:
                bad.append(f"{name} -> {side}")
    assert not bad, bad
