"""What the bench tests share: loading a ``bench/<name>.py`` script as a module."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str):
    """``bench/<name>.py`` imported as the module ``bench_<name>``; a generator for a
    module-scoped fixture (``yield from load(name)``), which removes it afterwards."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
