"""Test-wide settings: float32 comparisons use full-precision matmuls; programs compile at -O0;
each test file's compiled programs are dropped after it; the garbage collector runs less often.

Compiling dominates the suite's run time, and the backend's (LLVM's) -O0
halves it (measured on test_blockwise.py: 51 s of CPU at the default level,
23 s at -O0). XLA's CPU backend keeps IEEE float semantics at every level (no
fast-math), so the level changes the tests' speed, not their results. It must
be in XLA_FLAGS before the first computation starts the backend; subprocess
tests inherit it through ``BACKEND_O0``.

A worker that runs half the suite would otherwise hold every program it
compiled (5 GB by the end) and the collector would walk all of them again and
again: dropping them after each file and collecting at 20,000 allocations
instead of 700 took tests/models from 343 s to 269 s (2 workers, 2 cores).
"""

import gc
import os

BACKEND_O0 = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {BACKEND_O0}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
gc.set_threshold(20_000, 20, 20)  # tracing allocates many short-lived objects


@pytest.fixture
def scratch():
    """Names added by a test, removed again afterwards (the registries are process-wide):
    append ``(registry, name)``."""
    added = []
    yield added
    for registry, name in added:
        if name in registry:
            registry.remove(name)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """After each test file: its programs are rarely another file's (those that are come
    back from the compilation cache of tests/train/conftest.py)."""
    yield
    jax.clear_caches()
