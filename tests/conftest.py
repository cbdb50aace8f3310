"""Test-wide settings: float32 comparisons use full-precision matmuls; programs compile fast
(``COMPILE_FAST``) into one persistent compilation cache; each test file's compiled programs
are dropped after it; the garbage collector runs less often.

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

The persistent compilation cache is one folder for the whole run: the xdist
workers and the subprocess tests share it (the first process sets
``JAX_COMPILATION_CACHE_DIR`` and the others inherit it), and ``tools/test.sh``
gives all three tiers the same one. Programs that took 30 ms or more to compile
go in: the fast tier 239 s -> 217 s in a fresh clone (742 programs, 34 MB), the
same programs coming back to the other worker, to later files (whose in-memory
caches were dropped) and to the CLI's subprocesses.

A worker that runs half the suite would otherwise hold every program it
compiled (5 GB by the end) and the collector would walk all of them again and
again: dropping them after each file and collecting at 20,000 allocations
instead of 700 took tests/models from 343 s to 269 s (2 workers, 2 cores).
"""

import atexit
import gc
import os
import shutil
import tempfile
from importlib.metadata import version

COMPILE_FAST = (
    "--xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
if tuple(int(x) for x in version("jaxlib").split(".")[:2]) >= (0, 11):
    # jaxlib 0.11's XLA has no fusion-emitter flag, and an unknown XLA flag ends the process.
    COMPILE_FAST = COMPILE_FAST.replace(" --xla_cpu_use_fusion_emitters=false", "")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMPILE_FAST}".strip()
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnlab_xla_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"]

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.03)
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
    back from the persistent compilation cache)."""
    yield
    jax.clear_caches()


@pytest.fixture
def compilation_cache_dir():
    """The persistent compilation cache's folder, for subprocesses that set it explicitly."""
    return CACHE_DIR


def tier_errors(items) -> list[str]:
    """Tests that no tier of ``tools/test.sh`` would run, or would run without what they
    need: ``items`` are ``(nodeid, marker names)``. The devices tier runs ``-m devices
    tests/devices``, the others deselect ``devices``, so a ``devices`` test elsewhere runs
    nowhere, and a test in ``tests/devices`` without the marker (or with ``integration``
    too) runs in a tier without the 8 devices."""
    errors = []
    for nodeid, names in items:
        inside = nodeid.startswith("tests/devices/")
        if "devices" in names and not inside:
            errors.append(f"{nodeid}: marked devices outside tests/devices (runs in no tier)")
        elif inside and ("devices" not in names or "integration" in names):
            errors.append(f"{nodeid}: in tests/devices, expected the devices marker alone")
    return errors


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every tier sees every test
def pytest_collection_modifyitems(config, items):
    errors = tier_errors((item.nodeid, {m.name for m in item.iter_markers()}) for item in items)
    if errors:
        raise pytest.UsageError("tests in no tier of tools/test.sh:\n" + "\n".join(errors))
