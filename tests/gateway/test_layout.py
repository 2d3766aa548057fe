"""The shape of gateway/: no import cycles between its modules (not even through imports under
``if TYPE_CHECKING:`` or inside functions), no module over 400 lines, no capability found with
``getattr``. (The house rules of docs/ARCHITECTURE.md, checked.)"""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
GENERATED = GATEWAY / "grpc" / "quicserve"  # protoc's output (make proto)
MAX_LINES = 400
# getattr with a literal name: allowed only where the name is a platform constant, not a capability
GETATTR_ALLOWED = {("http/h1.py", "POLLRDHUP"),  # Linux only
                   ("workers/discovery.py", "EAI_NODATA"),  # a resolver error code glibc has and others lack
                   ("settings.py", "__name__")}  # a type's name for an error message
# Circles allowed when every import counts (type-only and function-level ones too): none. Never add
# one: a back reference is a Protocol in the module that needs it.
KNOWN_CIRCLES: list[frozenset[str]] = []


def _modules() -> dict[str, Path]:
    out = {}
    for path in GATEWAY.rglob("*.py"):
        if GENERATED in path.parents:
            continue
        rel = path.relative_to(GATEWAY.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str], *, everywhere: bool = False) -> set[str]:
    """Gateway modules imported at module level (not under ``if TYPE_CHECKING:``, not inside functions);
    ``everywhere``: by any import statement in the module, those included."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree) if everywhere else tree.body:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph(*, everywhere: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    graph = {name: _imports(name, path, set(mods), everywhere=everywhere) for name, path in mods.items()}
    for parent in [m for m in mods if mods[m].name == "__init__.py"]:  # a package's own __init__ is not a cycle
        for m in graph:
            graph[m].discard(parent) if m.startswith(parent + ".") else None
    return graph


def test_no_gateway_module_imports_one_that_imports_it_back() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles in gateway/: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_circle_even_through_type_only_or_function_imports() -> None:
    """A type-only import (``if TYPE_CHECKING:``) or one inside a function still ties two modules
    together: neither can be read, tested or moved without the other."""
    graph = _graph(everywhere=True)
    circles = [c for c in _circles(graph) if not any(c <= known for known in KNOWN_CIRCLES)]
    paths = [" -> ".join(path) for c in circles for path in _cycles({m: graph[m] & c for m in c})]
    assert not circles, "circles in gateway/ (a back reference is a Protocol in the module that needs it): " + \
        "; ".join(paths)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan): each module of one
    reaches every other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_the_circle_finder_finds_every_circle_whole() -> None:
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c", "e"}, "e": set(), "f": {"b"}}
    assert sorted(map(sorted, _circles(graph))) == [["a", "b"], ["c", "d"]]
    graph["d"].add("a")  # now a, b, c, d reach one another: one circle, not two
    assert _circles(graph) == [frozenset("abcd")]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_type_only_and_function_level_imports_count_as_edges(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import t\n"
                                   "def f() -> None:\n    from pkg import u\n")
    known = {"pkg.t", "pkg.u"}
    assert _imports("pkg.m", tmp_path / "m.py", known) == set()
    assert _imports("pkg.m", tmp_path / "m.py", known, everywhere=True) == {"pkg.t", "pkg.u"}


def test_no_gateway_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(GATEWAY)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by role: {long}"


def test_no_capability_is_found_with_getattr() -> None:
    found = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                     "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                where = (str(path.relative_to(GATEWAY)), node.args[1].value)
                if where not in GETATTR_ALLOWED:
                    found.append(where)
    assert not found, f"declare these in a type instead: {found}"


SETTINGS_IMPORTERS = {"gateway.cli", "gateway.serve", "gateway.reload",  # the entry points (serve's reload)
                      "gateway.multiproc.supervisor"}  # and the supervisor of several gateway processes


def test_only_the_entry_points_import_the_settings_collector() -> None:
    """Each package owns its section (its config.py); gateway/settings.py collects them, so a module
    that imported it back would point up the tree (the six arrows issue #27 removed)."""
    found = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                if base == "gateway.settings" or (base == "gateway" and any(a.name == "settings" for a in node.names)):
                    found.add(name)
            elif isinstance(node, ast.Import) and any(a.name == "gateway.settings" for a in node.names):
                found.add(name)
    assert found <= SETTINGS_IMPORTERS | {"gateway.settings"}, sorted(found - SETTINGS_IMPORTERS)
