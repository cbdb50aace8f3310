"""The sharded fixed-state families on one device, and their argument checks.

That they compute what one device computes on 2, 4 and 8 devices is checked in
the fake-device tier: ``tests/devices/test_sharded_linear.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import attn
from tests.util import normal, rel_err


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
