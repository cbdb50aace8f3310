"""Training tests share a persistent compilation cache (a temporary folder per process).

Runs that differ only in the learning rate, repeated model initializations and
the subprocesses of the CLI tests compile the same programs; caching them keeps
the suite fast. It is configured at import, before anything compiles, because
JAX reads the setting once, on its first compilation.
"""

import atexit
import shutil
import tempfile

import jax
import pytest

CACHE_DIR = tempfile.mkdtemp(prefix="attnlab_xla_cache_")
atexit.register(shutil.rmtree, CACHE_DIR, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


@pytest.fixture
def compilation_cache_dir():
    """The cache folder, for subprocesses (``JAX_COMPILATION_CACHE_DIR``)."""
    return CACHE_DIR
