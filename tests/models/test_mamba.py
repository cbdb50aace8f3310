"""The Mamba-2 layer and the delta layer's new options: configs, the layer's pieces, weights.

Decoding (chunked prefill + steps == forward), packing and serving of these
kinds run with every other kind's in ``test_decoding``, ``test_models`` and
``test_serving`` (the ``ssm_hybrid`` stack of ``common.KINDS``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
import models
from tests.util import rel_err

WIDTH = 16


def layer(**fields):
    cfg = models.Mamba2Config(num_heads=4, head_dim=4, state_dim=6, groups=2, **fields)
    return models.Mamba2(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )


@pytest.mark.parametrize("negative", [False, True])
def test_the_layer_is_its_paper_s_composition(negative):
    """``Mamba2`` equals the block written out: projection split (z, x, B, C, dt), conv with
    bias and SiLU, softplus(dt + dt_bias), A = -exp(A_log), SSD with D, norm(y silu(z))."""
    m = layer(negative_eigenvalues=negative)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 7, WIDTH)), jnp.float32)
    z, xbc, dt_raw = np.split(np.asarray(m.in_proj(x)), [16, 16 + 16 + 24], axis=-1)
    conv = attn.short_conv(xbc, m.conv_weight[...], m.conv_bias[...])[0]
    conv = np.asarray(jax.nn.silu(conv))
    xs, b, c = np.split(conv, [16, 28], axis=-1)
    dt = jax.nn.softplus(dt_raw + m.dt_bias[...])
    y = attn.ssd(
        xs.reshape(2, 7, 4, 4),
        dt,
        -jnp.exp(m.A_log[...]),
        b.reshape(2, 7, 2, 6),
        c.reshape(2, 7, 2, 6),
        D=m.D[...],
        negative_eigenvalues=negative,
        form="recurrent",
    ).reshape(2, 7, 16)
    gated = (y * jax.nn.silu(z)).reshape(2, 7, 2, 8)
    normed = gated / np.sqrt(np.mean(np.square(gated), -1, keepdims=True) + 1e-5)
    want = m.o_proj(normed.reshape(2, 7, 16) * m.norm_weight[...])
    assert rel_err(m(x), want) <= 1e-5
    if negative:  # the initial dt reaches decays below 0 only with large steps: check one
        log_a, neg = attn.linear.ssd_decay(jnp.asarray([5.0]), jnp.asarray([-1.0]), True)
        assert bool(neg[0]) and float(log_a[0]) < 0


def test_captured_weights_give_the_ssd_output():
    """The weights tap is M with ``y = M x`` (D on its diagonal): M times x is the SSD output."""
    m = layer()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 6, WIDTH)), jnp.float32)
    _, (weights,) = models.capture_weights(m, x)
    xbc, ctx = m._front(x, None, None)
    p = m._inputs(x, attn.short_conv(xbc, m.conv_weight[...], m.conv_bias[...])[0], ctx)
    A, D = m._params()
    xs = p["x"]
    y = attn.ssd(xs, p["dt"], A, B=p["b"], C=p["c"], D=D)
    assert weights.shape == (1, 4, 6, 6)
    np.testing.assert_array_equal(np.triu(np.asarray(weights), 1), 0.0)  # causal
    assert rel_err(jnp.einsum("bnts,bsne->btne", weights, xs), y) <= 1e-5


def test_configs_refuse_what_their_layers_cannot_take():
    for change, field in (
        (dict(groups=3), "groups"),
        (dict(form="parallel"), "form"),
        (dict(rope=True), "rope"),
        (dict(num_kv_heads=2), "num_kv_heads"),
        (dict(negative_eigenvalues=1), "negative_eigenvalues"),
        (dict(state_dim=0), "state_dim"),
        (dict(conv=0), "conv"),
    ):
        with pytest.raises(ValueError, match=f"^{field}: expected"):
            models.Mamba2Config(num_heads=4, **change)
    delta = models.presets()["gated_deltaproduct"]
    assert (delta.householder_steps, delta.negative_eigenvalues) == (2, True)
    for change, field in (
        (dict(householder_steps=0), "householder_steps"),
        (dict(negative_eigenvalues="yes"), "negative_eigenvalues"),
    ):
        with pytest.raises(ValueError, match=f"^{field}: expected"):
            dataclasses.replace(delta, **change)
    with pytest.raises(ValueError, match=r"^cfg\.kind: expected"):
        models.Mamba2(
            models.Mamba2Config(), 8, causal=False, dtype=jnp.float32,
            param_dtype=jnp.float32, rngs=nnx.Rngs(0),
        )  # fmt: skip


def test_delta_layer_betas_reach_two_with_negative_eigenvalues():
    """beta = 2 sigmoid(.) with negative eigenvalues, one per step and value head."""
    cfg = dataclasses.replace(models.presets()["gated_deltaproduct"], householder_steps=3)
    m = models.DeltaAttention(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    m.beta_proj.kernel.set_value(m.beta_proj.kernel[...] * 5)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 5, WIDTH)), jnp.float32)
    beta, _ = m._beta_and_gates(x)
    assert beta.shape == (1, 5, 3, cfg.num_value_heads)
    assert 1.5 < float(beta.max()) <= 2 and float(beta.min()) >= 0
