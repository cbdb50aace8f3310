"""Test-wide settings: float32 comparisons use full-precision matmuls; programs compile fast
(``COMPILE_FAST``); each test file's compiled programs are dropped after it; the garbage
collector runs less often.

Compiling dominates the suite's run time (the backend's compile is two thirds of
a test file's time), so the tests ask XLA's CPU backend for cheap code:
LLVM at -O0 halves it (test_blockwise.py: 51 s of CPU at the default level, 23
s at -O0); the classic elemental emitters instead of the MLIR fusion emitters,
and codegen in one piece instead of split over threads that the two xdist
workers already keep busy, take tests/models/test_decoding.py's backend compile
from 37.5 s to 16.6 s (298 programs; its wall time 56 s -> 37 s). None of them
turns on fast-math: XLA's CPU backend keeps IEEE float semantics, so they change
the tests' speed, not what they check. They must be in XLA_FLAGS before the
first computation starts the backend; subprocess tests inherit them.

A worker that runs half the suite would otherwise hold every program it
compiled (5 GB by the end) and the collector would walk all of them again and
again: dropping them after each file and collecting at 20,000 allocations
instead of 700 took tests/models from 343 s to 269 s (2 workers, 2 cores).
"""

import gc
import os

COMPILE_FAST = (
    "--xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMPILE_FAST}".strip()

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
