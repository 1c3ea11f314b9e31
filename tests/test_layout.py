"""normswap's units (a top-level module or a subpackage) import downward only: no cycle between units,
imports inside functions included (they are how a cycle hides)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "normswap"


def _unit(module: str) -> str | None:
    """``normswap.io.save`` -> ``io``; ``normswap.cli`` -> ``cli``; ``normswap`` -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "normswap" else None


def _imported(path: Path, module: str) -> set[str]:
    """The normswap modules (and module.name candidates) ``path`` imports, anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("normswap.")}


def unit_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("_")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        unit = _unit(module)
        if unit is None:
            continue
        for name in _imported(path, module):
            target = _unit(name)
            if target in units and target != unit:
                graph.setdefault(unit, set()).add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_units():
    graph = unit_graph()
    assert {"io", "check", "stream", "pipeline"} <= set(graph)  # the walk saw the package
    assert cycles(graph) == [], {u: sorted(graph[u]) for c in cycles(graph) for u in c}


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_reaches_its_subpackages_on_first_use():
    """``import normswap`` imports no torch; ``normswap.io.load_model`` then works without ``import
    normswap.io`` (as docs/API.md's names are reached), while ``normswap.check`` and ``normswap.convert``
    stay the functions, and an unknown name is an ``AttributeError``."""
    import subprocess
    import sys

    script = """
import sys
import normswap
assert "torch" not in sys.modules
from normswap.io import load_model
assert normswap.io.load_model is load_model
assert callable(normswap.check) and callable(normswap.convert) and callable(normswap.convert_pretrained)
try:
    normswap.no_such_name
except AttributeError as error:
    assert "no_such_name" in str(error)
else:
    raise AssertionError("an unknown name resolved")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
