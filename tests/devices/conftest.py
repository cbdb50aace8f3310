"""The fake-device tier: checks that need 8 CPU devices, in a pytest process of their own.

The device count must be in ``XLA_FLAGS`` before JAX starts, so this folder runs
apart from the rest (``tools/test.sh`` does)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -m devices tests/devices

Every module here is marked ``devices``, which the default run leaves out.
"""

import jax
import pytest

DEVICES = 8
HOW = f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} python -m pytest -m devices"


@pytest.fixture(autouse=True, scope="session")
def _fake_devices():
    if jax.device_count() < DEVICES:
        pytest.fail(f"tests/devices needs {DEVICES} devices, found {jax.device_count()}: {HOW}")
