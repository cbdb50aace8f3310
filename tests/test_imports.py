"""The import graph: no cycles, and data flowing one way (configs -> train -> models -> attn).

Parsed from the sources (``ast``), not imported, so a lazy import inside a
function counts as much as one at the top of a file: a cycle hidden in a
function body is still a cycle. A package's own ``__init__`` is not an edge
of its submodules (Python runs it first, whatever imports them).
"""

from __future__ import annotations

import ast
import sys
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


def private_uses(path: Path, modules: dict[str, Path]) -> list[str]:
    """``module._name`` uses of another project module's private names in ``path``.

    Both ``from m import _name`` and ``m._name`` on a module imported as ``m``
    (dunders are not private). Tests may reach internals; sources may not.
    """
    own = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    tree = ast.parse(path.read_text(), str(path))
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name in modules:  # a submodule: later `alias._x` uses are checked
                    aliases[alias.asname or alias.name] = name
                elif _private(alias.name) and node.module != own:
                    found.append(
                        f"{path.name}:{node.lineno} from {node.module} import {alias.name}"
                    )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target = _dotted(node.value)
            module = aliases.get(target) if target is not None else None
            if module is None and target in modules:
                module = target
            if module is not None and module != own:
                found.append(f"{path.name}:{node.lineno} {target}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node) -> str | None:
    """``a.b.c`` of a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def test_no_source_file_imports_another_modules_private_names():
    modules = _modules()
    found = [use for path in modules.values() for use in private_uses(path, modules)]
    assert len(modules) > 50
    assert found == []


def test_private_uses_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a").mkdir()
    source = tmp_path / "a" / "b.py"
    source.write_text(
        "from a.c import _hidden, shown\nimport a.c\nfrom a import c as cc\n"
        "a.c._also(cc._third, a.c.__name__)\n"
    )
    modules = {"a.b": source, "a.c": tmp_path / "a" / "c.py", "a": tmp_path / "a"}
    assert private_uses(source, modules) == [
        "b.py:1 from a.c import _hidden",
        "b.py:4 a.c._also",
        "b.py:4 cc._third",
    ]


# The public surface of ``models``: the models, the layer modules and their per-kind
# configs, the kind registry, presets and patterns, decoding and serving, and the
# operations a researcher calls on a model. Building blocks (caches, heads, blocks)
# are imported from their submodules; one package exports each helper.
MODELS_ALL = {
    *("Decoder", "Encoder", "EncoderDecoder", "ModelConfig"),
    *("SelfAttention", "CrossAttention", "LatentAttention", "LinearAttention"),
    *("DeltaAttention", "DiffAttention", "Mamba2", "FunctionAttention"),
    *("MobaAttention", "NSAAttention", "DSAAttention"),
    *("Rwkv7Attention", "PathAttention", "CombaAttention", "CombaConfig"),
    *("AttentionConfig", "MaskedConfig", "SoftmaxConfig", "LatentConfig", "LinearConfig"),
    *("DeltaConfig", "DiffConfig", "Mamba2Config", "FunctionConfig"),
    *("MobaConfig", "NSAConfig", "DSAConfig"),
    *("Rwkv7Config", "PathConfig", "LogLinearMamba2Config", "LogLinearDeltaConfig"),
    *("TTTAttention", "TTTConfig", "TitansAttention", "TitansConfig"),
    *("MesaAttention", "MesaConfig", "LightningAttention", "LightningConfig"),
    *("KINDS", "LayerKind", "register_kind", "attention_kind"),
    *("PRESET_REGISTRY", "PresetSizes", "Presets", "presets", "register_preset"),
    *("pattern", "describe", "LAYOUTS", "layout"),
    *("generate", "serve", "cache_bytes"),
    *("capture_weights", "head_gates", "set_head_gates", "head_importance"),
    "packed_positions",
}


def test_models_exports_its_public_surface_and_nothing_of_attn():
    import attn
    import models

    assert len(models.__all__) == len(set(models.__all__))
    assert set(models.__all__) == MODELS_ALL
    for name in models.__all__:
        assert getattr(models, name) is not None, name
    assert not set(attn.__all__) & set(models.__all__)
    # attn lifts attn.linear's names whole: each once, each there, each a family's module's.
    assert len(attn.__all__) == len(set(attn.__all__))
    assert set(attn.linear.__all__) <= set(attn.__all__)
    for name in attn.__all__:
        assert getattr(attn, name) is not None, name
    for name in attn.linear.__all__:
        assert getattr(attn, name) is getattr(attn.linear, name), name
    # The building blocks have one home each, their submodule.
    for gone in ("KVCache", "DecodeCache", "Heads", "Block", "EMPTY", "latent_cache_bytes"):
        assert not hasattr(models, gone), gone


# Sizes that show the design: no written file past 500 lines (the committed results, data the
# runs write, are not written by hand).
MAX_LINES = 500
WRITTEN = ("*.py", "*.sh", "*.md", "*.toml", "*.cfg", "*.txt")


def test_no_written_file_is_over_500_lines():
    skip = {".git", ".venv", "results", "node_modules", "__pycache__", ".pytest_cache"}
    long = {}
    for pattern in WRITTEN:
        for path in ROOT.rglob(pattern):
            parts = path.relative_to(ROOT).parts
            if skip & set(parts) or any(p.endswith(".egg-info") for p in parts):
                continue
            count = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
            if count > MAX_LINES:
                long[str(path.relative_to(ROOT))] = count
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_a_test_is_refused_where_no_tier_of_tools_test_sh_runs_it():
    """(A devices test outside tests/devices ran in no tier, and tools/test.sh exited 0.)"""
    from tests.conftest import tier_errors

    assert tier_errors([("tests/attn/test_x.py::t", set()),
                        ("tests/devices/test_y.py::t", {"devices"}),
                        ("tests/train/test_z.py::t", {"integration"})]) == []  # fmt: skip
    errors = tier_errors([("tests/attn/test_x.py::t", {"devices"}),
                          ("tests/devices/test_y.py::t", set()),
                          ("tests/devices/test_y.py::u", {"devices", "integration"})])  # fmt: skip
    assert len(errors) == 3 and "runs in no tier" in errors[0]
    assert all("expected the devices marker alone" in e for e in errors[1:])


def test_dry_runs_write_where_the_tree_ignores_them():
    """(``bench/gpu.py --dry-run`` left ``bench/results/gpu-dry-run.*`` untracked.)"""
    import fnmatch

    patterns = [p for p in (ROOT / ".gitignore").read_text().splitlines() if "/" in p]
    for name in ("gpu", "tuned", "device"):
        for ext in ("json", "md", "png"):
            path = f"bench/results/{name}-dry-run.{ext}"
            assert any(fnmatch.fnmatch(path, p.strip("/")) for p in patterns), path


def test_every_public_function_and_kind_is_named_in_the_docs():
    """Each function ``attn`` exports and each registered layer kind is named in the README
    or docs/architecture.md (the docs had fallen behind the families added)."""
    import re

    import attn
    import models

    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "architecture.md").read_text()
    named = lambda name: re.search(rf"\b{re.escape(name)}\b", text)  # noqa: E731
    public = [n for n in attn.__all__ if callable(getattr(attn, n))]
    assert [n for n in public if not named(n)] == []
    assert [k for k in models.KINDS if not named(k)] == []


def test_every_module_is_in_the_architecture_table():
    """Each module of the packages is named in docs/architecture.md's table, which maps
    modules to the sections that describe them: a row starts with its folder, then names
    files (``loop.py``), module names (``flash``) or a whole subfolder (``experiments/``)."""
    lines = (ROOT / "docs" / "architecture.md").read_text().splitlines()
    cells = [line.split("|")[1] for line in lines if line.startswith("| `")]

    def named(path: Path) -> bool:
        folder = path.parent.relative_to(ROOT).as_posix()
        parent, sub = folder.rsplit("/", 1) if "/" in folder else ("", folder)
        return any(
            (cell.strip().startswith(f"`{folder}/") and
             any(f"`{x}`" in cell for x in (path.name, path.stem, f"{folder}/{path.name}")))
            or (parent and cell.strip().startswith(f"`{parent}/") and f"`{sub}/`" in cell)
            for cell in cells
        )  # fmt: skip

    modules = [
        p for pkg in ("attn", "models", "train", "analysis") for p in (ROOT / pkg).rglob("*.py")
    ]
    missing = [str(p.relative_to(ROOT)) for p in sorted(modules) if p.name != "__init__.py"
               and not named(p)]  # fmt: skip
    assert missing == []


NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
NUMBERS = (NUMBERS + "fifteen sixteen seventeen eighteen nineteen twenty").split()


def test_counts_in_the_docs_are_the_code_s():
    """A count of variants or kinds in the README or the design docs is the code's (the main
    job's variants, the registered kinds); the committed results' pages count their runs."""
    import re

    import models
    from configs import compare_mqar

    counts = {"variants": len(compare_mqar.VARIANTS), "kinds": len(models.KINDS)}
    pattern = re.compile(
        rf"\b({'|'.join(NUMBERS)}|\d+) (?:attention |layer )?(variants|kinds)\b", re.IGNORECASE
    )
    docs = ["README.md", *(f"docs/{n}.md" for n in ("architecture", "models-and-training",
                                                     "families", "extending"))]  # fmt: skip
    found = []
    for doc in docs:
        for number, what in pattern.findall((ROOT / doc).read_text()):
            n = int(number) if number.isdigit() else NUMBERS.index(number.lower())
            found.append((doc, number, what))
            assert n == counts[what], f"{doc}: {number} {what}, the code has {counts[what]}"
    assert found  # the main job's count is quoted (README), so this reads something
