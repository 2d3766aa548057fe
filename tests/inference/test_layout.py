"""The shape of inference/: no import circle of any kind, one place that asks which backend it is on,
no module using another's private names, one module named ``runner``. (The house rules of
docs/ARCHITECTURE.md, checked.)

Every import counts, wherever it is written: at module level, under ``if TYPE_CHECKING:`` and inside
functions (``tests/gateway/test_layout.py``'s import finder, everywhere), and no circle is excused. A
lazy import hides a circle from Python's import machinery, not from a reader."""

from __future__ import annotations

import ast
import graphlib
from functools import partial
from pathlib import Path

from tests.gateway.test_layout import _imports as _gateway_imports

_imports = partial(_gateway_imports, everywhere=True)  # every import statement, wherever it is written

INFERENCE = Path(__file__).resolve().parents[2] / "inference"
SEAM = "inference.kernels.kernel_set"  # the kernel seam: the one module that asks where it runs
# Names that ask JAX which platform this process runs on.
BACKEND_QUESTIONS = frozenset({"default_backend", "devices", "local_devices", "get_backend", "backends"})


def _modules() -> dict[str, Path]:
    out = {}
    for path in INFERENCE.rglob("*.py"):
        parts = list(path.relative_to(INFERENCE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (module -> modules it imports), or []."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(reversed(exc.args[1]))  # graphlib lists it against the arrows
    return []


def test_no_import_circle_of_any_kind() -> None:
    circle = _circle(_graph())
    assert not circle, "import circle in inference/: " + " -> ".join(circle)


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The finder counts an import inside a function and one under TYPE_CHECKING (a test that cannot fail
    is a bug: this one would pass on an empty graph)."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from inference import b\n")
    b.write_text("def f():\n    from inference import a\n")
    known = {"inference.a", "inference.b"}
    graph = {"inference.a": _imports("inference.a", a, known), "inference.b": _imports("inference.b", b, known)}
    assert _circle(graph) in (["inference.a", "inference.b", "inference.a"], ["inference.b", "inference.a", "inference.b"])
    assert "inference.kernels.quant" in _graph()["inference.kernels.pallas"]  # a real edge is seen


def test_only_the_kernel_seam_asks_which_backend_it_is_on() -> None:
    found = []
    for name, path in _modules().items():
        if name == SEAM:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            asked = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                     else None)  # fmt: skip
            if asked in BACKEND_QUESTIONS:
                found.append(f"{path.relative_to(INFERENCE.parent)}:{node.lineno} {asked}")
            if isinstance(node, ast.ImportFrom) and any(a.name in BACKEND_QUESTIONS for a in node.names):
                found.append(f"{path.relative_to(INFERENCE.parent)}:{node.lineno} imports it")
    assert not found, f"ask the kernel set instead ({SEAM}.current_platform, KernelSet.platform): {found}"
    seam = _modules()[SEAM].read_text()
    assert "jax.default_backend()" in seam  # the seam is where the one question is


def _private_uses(name: str, path: Path, known: set[str]) -> list[str]:
    """Private names (``_x``, not dunders) of other inference/ modules that ``name`` reaches: imported
    by name, or read as ``module._x`` through a module it imported."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            up = pkg.split(".")[: len(pkg.split(".")) - max(node.level - 1, 0)] if node.level else []
            base = ".".join([*up, node.module] if node.module else up)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif base in known and a.name.startswith("_") and not a.name.startswith("__") and base != name:
                    found.append(f"{base}.{a.name}")
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names() -> None:
    """What one module uses of another is its public surface (calibration, for one, goes through the
    Model protocol, not Llama's helpers)."""
    mods = _modules()
    found = {n: uses for n, p in mods.items() if (uses := _private_uses(n, p, set(mods)))}
    assert not found, f"make these public (or move the caller): {found}"


def test_exactly_one_module_named_runner() -> None:
    named = sorted(n for n in _modules() if n.rpartition(".")[2] == "runner")
    assert named == ["inference.runner"], f"one module named runner, the scheduler's contract: {named}"
