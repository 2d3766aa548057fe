"""The shape of gateway/: no import cycles between its modules, no module over 400 lines, no
capability found with ``getattr``. (The house rules of docs/ARCHITECTURE.md, checked.)"""

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


def _runtime_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Gateway modules imported at module level (not under ``if TYPE_CHECKING:``, not inside functions)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in tree.body:
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


def test_no_gateway_module_imports_one_that_imports_it_back() -> None:
    mods = _modules()
    graph = {name: _runtime_imports(name, path, set(mods)) for name, path in mods.items()}
    for parent in [m for m in mods if mods[m].name == "__init__.py"]:  # a package's own __init__ is not a cycle
        for m in graph:
            graph[m].discard(parent) if m.startswith(parent + ".") else None
    cycles = _cycles(graph)
    assert not cycles, "import cycles in gateway/: " + "; ".join(" -> ".join(c) for c in cycles)


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


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


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
