"""The fixed-state families over a sharded sequence compute what one device computes.

The multi-device cases run in one subprocess on 8 fake CPU devices
(``tests/attn/linear/sharded_checks.py``): every family on 8 devices of an
Explicit mesh (all-gather exchange) and 4 of an Auto one (associative scan),
both with packed segments crossing device boundaries and NaN in the padding,
and each function on 2 without segments; T = 27 a multiple of none, an
initial state, the final state and every gradient. The argument
checks need no devices and run here.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import attn
from tests import fake_devices
from tests.attn.linear import sharded_checks
from tests.util import normal, rel_err

CHECKS_TIMEOUT_S = 600


@pytest.fixture
def checks(tmp_path_factory):
    argv = ["-m", "tests.attn.linear.sharded_checks"]
    return fake_devices.results(tmp_path_factory, "sharded_checks", argv, CHECKS_TIMEOUT_S)


@pytest.mark.parametrize("case", sorted(sharded_checks.CASES))
def test_sharded_case(checks, case):
    assert case in checks, f"sharded_checks did not report {case}"
    result = checks[case]
    assert result["ok"], json.dumps(result, indent=1)
    assert result["errors"]["out"] <= sharded_checks.FORWARD_TOL


def test_every_family_is_checked_on_both_mesh_types(checks):
    for name in sharded_checks.FAMILIES:
        assert f"{name}_8_explicit" in checks and f"{name}_4_auto_scan" in checks


def one_device_mesh():
    return Mesh(np.array(jax.devices()[:1]), ("seq",))


def test_one_device_is_the_plain_call():
    q, k, v = normal(0, (2, 9, 2, 4)), normal(1, (2, 9, 2, 4)), normal(2, (2, 9, 2, 4))
    beta = jax.nn.sigmoid(normal(3, (2, 9, 2)))
    want = attn.delta_rule(q, k, v, beta, chunk_size=4)
    mesh = one_device_mesh()
    sharded = jax.jit(
        lambda *a: attn.sharded_delta_rule(*a, chunk_size=4, axis_name="seq", mesh=mesh)
    )
    got = sharded(q, k, v, beta)
    assert rel_err(got, want) < 1e-6


def test_arguments_are_checked_with_their_whole_shapes():
    q, k, v = normal(0, (2, 9, 2, 4)), normal(1, (2, 9, 2, 4)), normal(2, (2, 9, 2, 4))
    mesh = one_device_mesh()
    with pytest.raises(ValueError, match=r"^axis_name: expected an axis of the mesh"):
        attn.sharded_linear_attention(q, k, v, axis_name="data", mesh=mesh)
    with pytest.raises(ValueError, match=r"^mesh: expected a jax.sharding.Mesh"):
        attn.sharded_linear_attention(q, k, v, axis_name="seq", mesh="seq")
    with pytest.raises(ValueError, match=r"^causal: expected True"):
        attn.sharded_linear_attention(q, k, v, axis_name="seq", mesh=mesh, causal=False)
    with pytest.raises(ValueError, match=r"^log_gates: expected shape \(2, 9, 2\)"):
        attn.sharded_linear_attention(
            q, k, v, log_gates=jnp.zeros((2, 9, 3)), axis_name="seq", mesh=mesh
        )
    beta = jnp.ones((2, 9, 2))
    with pytest.raises(ValueError, match=r"^q_segment_ids/kv_segment_ids: expected both"):
        attn.sharded_delta_rule(
            q, k, v, beta, q_segment_ids=jnp.ones((2, 9), int), axis_name="seq", mesh=mesh
        )
    with pytest.raises(ValueError, match=r"^initial_state: expected shape \(2, 2, 4, 4\)"):
        attn.sharded_delta_rule(
            q, k, v, beta, initial_state=jnp.zeros((2, 2, 4, 5)), axis_name="seq", mesh=mesh
        )
    with pytest.raises(ValueError, match=r"^weight: expected"):
        attn.sharded_short_conv(normal(0, (2, 9, 6)), jnp.ones((4, 5)), axis_name="seq", mesh=mesh)
    with pytest.raises(ValueError, match=r"^exchange: expected one of \('gather', 'scan'\)"):
        attn.sharded_delta_rule(q, k, v, beta, axis_name="seq", mesh=mesh, exchange="ring")
    with pytest.raises(ValueError, match=r"^A: expected shape \(2,\)"):
        attn.sharded_ssd(v, jnp.ones((2, 9, 2)), jnp.ones((3,)), q, k, axis_name="seq", mesh=mesh)
