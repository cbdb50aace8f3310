"""The import graph: no cycles, and data flowing one way (configs -> train -> models -> attn).

Parsed from the sources (``ast``), not imported, so a lazy import inside a
function counts as much as one at the top of a file: a cycle hidden in a
function body is still a cycle. A package's own ``__init__`` is not an edge
of its submodules (Python runs it first, whatever imports them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attn", "models", "train", "analysis", "configs", "bench")
# What each layer may import from the project (besides itself). analysis's
# experiment runners and claims runner train models, so they may import train.
ALLOWED = {
    "attn": set(),
    "models": {"attn"},
    "analysis": {"attn", "models"},
    "analysis.experiments": {"attn", "models", "train", "analysis"},
    "analysis.claims": {"attn", "models", "train", "analysis"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from a import b` imports module a.b when there is one, else a name of a.
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in modules else node.module for n in names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "attn.softmax.call" in graph  # the walk found the packages
    assert cycles(graph) == []


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def _governed_by(module: str, layer: str) -> bool:
    """Whether ``layer`` is the most specific rule of ``ALLOWED`` that covers ``module``."""
    covering = [rule for rule in ALLOWED if module == rule or module.startswith(f"{rule}.")]
    return max(covering, key=len, default=None) == layer


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_import_only_what_is_below_them(layer):
    graph = import_graph()
    own = [m for m in graph if _governed_by(m, layer)]
    allowed = {layer.split(".")[0], *ALLOWED[layer]}
    wrong = {m: sorted(i for i in graph[m] if i.split(".")[0] not in allowed) for m in own}
    assert own, layer
    assert not {m: w for m, w in wrong.items() if w}
