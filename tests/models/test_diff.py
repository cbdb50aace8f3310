"""Differential attention (``models.diff``) against the Diff Transformer's formula, in float64.

The oracle is written from the paper: per head, two softmax maps of the two
query/key halves, ``(softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T / sqrt(d))) V``,
``lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init``, a per-head RMSNorm times
``1 - lambda_init``, then the output projection. Decoding, packing and GQA ride
on the model tests' ``KINDS["diff"]`` (tests/models/common.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.diff import depth_lambda_init
from tests.models.common import WIDTH, B
from tests.util import normal, rel_err


def paper_diff(layer, x, mask):
    """Float64 NumPy of the paper's equations from the layer's parameters."""
    cfg = layer.cfg
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    f64 = lambda p: np.asarray(p[...], np.float64)  # noqa: E731
    x = np.asarray(x, np.float64)
    T = x.shape[1]
    q = (x @ f64(layer.q_proj.kernel)).reshape(B, T, N, 2, H)
    k = (x @ f64(layer.k_proj.kernel)).reshape(B, T, K, 2, H)
    v = (x @ f64(layer.v_proj.kernel)).reshape(B, T, K, 2 * H)
    G = N // K
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)

    def softmax_map(i):
        s = np.einsum("btnh,bsnh->bnts", q[..., i, :], k[..., i, :]) / np.sqrt(H)
        s = np.where(mask, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        return s / s.sum(-1, keepdims=True)

    lq1, lk1, lq2, lk2 = f64(layer.lambdas)
    lam = np.exp(lq1 @ lk1) - np.exp(lq2 @ lk2) + cfg.lambda_init
    out = np.einsum("bnts,bsne->btne", softmax_map(0) - lam * softmax_map(1), v)
    rms = np.sqrt((out**2).mean(-1, keepdims=True) + 1e-5)
    out = out / rms * f64(layer.head_norm.scale) * (1 - cfg.lambda_init)
    return out.reshape(B, T, N * 2 * H) @ f64(layer.o_proj.kernel)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_diff_layer_is_the_papers_formula(kv_heads):
    cfg = models.DiffConfig(num_heads=4, head_dim=8, num_kv_heads=kv_heads, rope=False)
    layer = models.DiffAttention(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(3)
    )
    layer.head_norm.scale.set_value(1 + 0.1 * normal(1, (16,)))  # not the identity
    x = normal(2, (B, 10, WIDTH))
    got = jax.jit(lambda x: layer(x))(x)
    mask = np.tril(np.ones((10, 10), bool))
    assert rel_err(got, paper_diff(layer, x, mask)) <= 1e-5


def test_lambda_init_by_depth_and_checks():
    assert depth_lambda_init(1) == pytest.approx(0.2)
    assert depth_lambda_init(100) == pytest.approx(0.8)
    with pytest.raises(ValueError, match=r"^lambda_init: expected a number in \[0, 1\)"):
        models.DiffConfig(lambda_init=1.0)
    with pytest.raises(TypeError, match="'score'"):  # a softmax layer's field
        models.DiffConfig(score="alibi")
    assert models.presets()["diff"].kind == "diff"
