"""Comba's layer (``models.CombaAttention``) is fla's ``Comba`` composition written out: q/k/v
projections and SiLU convolutions, p = k sigmoid(d), q - D p, the three L2-normalized, beta,
the Mamba-2 decay, ``attn.comba``, the per-head RMSNorm and the sigmoid output gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
import models
from tests.util import rel_err

WIDTH, B, T = 16, 2, 7


def layer(**fields):
    cfg = models.CombaConfig(num_heads=2, head_dim=4, value_heads=4, chunk_size=4, **fields)
    m = models.CombaAttention(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    m.inner_decay.set_value(jnp.asarray([0.5, -1.0]))  # not the init: p is still k's direction
    m.D.set_value(jnp.asarray([0.3, 1.2]))
    return m


def written_out(m, x):
    unit = lambda a: a / jnp.sqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6)  # noqa: E731
    mixed = jax.nn.silu(attn.short_conv(m.qkv_proj(x), m.conv[...])[0])
    q, k, v = (a for a in np.split(np.asarray(mixed), [8, 16], axis=-1))
    q, k = q.reshape(B, T, 2, 4), k.reshape(B, T, 2, 4)
    p = k * jax.nn.sigmoid(m.inner_decay[...])[:, None]
    q = q - m.D[...][:, None] * p
    beta = jax.nn.sigmoid(m.beta_proj(x))
    log_g = -jnp.exp(m.A_log[...]) * jax.nn.softplus(m.gate_proj(x) + m.dt_bias[...])
    out = attn.comba(unit(q), unit(k), v.reshape(B, T, 4, 4), unit(p), beta, log_gates=log_g,
                     form="recurrent")  # fmt: skip
    normed = out / jnp.sqrt(jnp.mean(out * out, -1, keepdims=True) + 1e-6) * m.out_norm.scale[...]
    gate = jax.nn.sigmoid(m.out_gate(x)).reshape(B, T, 4, 4)
    return m.o_proj((normed * gate).reshape(B, T, 16))


def test_the_layer_is_fla_s_composition():
    m = layer()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, WIDTH)), jnp.float32)
    assert rel_err(nnx.jit(lambda m, x: m(x))(m, x), written_out(m, x)) <= 1e-5


def test_the_kind_and_its_config():
    assert models.KINDS["comba"].module is models.CombaAttention
    assert models.KINDS["comba"].sequence_parallel is True
    assert models.presets()["comba"].kind == "comba"
    with pytest.raises(ValueError, match=r"^householder_steps: expected"):
        models.CombaConfig(num_heads=2, householder_steps=2)
