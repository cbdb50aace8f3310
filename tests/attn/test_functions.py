"""Sigmoid attention and softpick against float64 oracles written from their papers' equations.

Sigmoid (Ramapuram et al. 2024): ``w_ts = sigmoid(s_ts - log n_t)`` over the n_t keys
query t sees. Softpick (Zuhri et al. 2025): ``w_ts = relu(e^{s_ts} - 1) / (sum |e^{s_ts'}
- 1| + eps)``. Both under GQA, a causal mask, packed segments with padding, a score
modifier and a bias, outputs and every gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks, scores
from attn.functions import SOFTPICK_EPS
from tests.util import normal, qkv, rel_err

B, T, N, K, H = 2, 10, 4, 2, 8
SEG = np.array([[1] * 4 + [2] * 6, [1] * 7 + [0] * 3])  # packed; row 1 ends in padding


def oracle(name, q, k, v, bias):
    """Float64, from the definitions; ``bias`` [N] is an ALiBi slope per head."""
    q, k, v = (x.astype(jnp.float64) for x in (q, k, v))
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    seg = jnp.asarray(SEG)
    ok = (s <= t) & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    ok = ok[:, None]  # [B,1,T,S]
    x = jnp.einsum("btnh,bsnh->bnts", q, k) * H**-0.5 - bias[None, :, None, None] * (t - s)
    if name == "sigmoid":
        n = jnp.maximum(ok.sum(-1, keepdims=True), 1)
        w = jnp.where(ok, jax.nn.sigmoid(x - jnp.log(n)), 0.0)
    else:
        e = jnp.where(ok, jnp.expm1(jnp.where(ok, x, 0.0)), 0.0)
        w = jax.nn.relu(e) / (jnp.abs(e).sum(-1, keepdims=True) + SOFTPICK_EPS)
    return jnp.einsum("bnts,bsne->btne", w, v)


FUNCTIONS = {"sigmoid": attn.sigmoid_attention, "softpick": attn.softpick_attention}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_matches_the_float64_oracle_with_gradients(name):
    q, k, v = qkv(1, B=B, T=T, N=N, K=K, H=H)
    slopes = jnp.asarray(scores.alibi_slopes(N))
    seg = jnp.asarray(SEG, jnp.int32)
    dout = normal(2, (B, T, N, H))

    def ours(q, k, v, slopes):
        out = FUNCTIONS[name](q, k, v, mask=masks.causal(), score_mod=scores.alibi(slopes),
                              q_segment_ids=seg, kv_segment_ids=seg)  # fmt: skip
        return (out * dout).sum(), out

    (_, out), grads = jax.value_and_grad(ours, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, slopes)
    with jax.enable_x64(True):
        x64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, slopes, dout)]
        want_out = oracle(name, *x64[:4])
        want = jax.grad(
            lambda q, k, v, b: (oracle(name, q, k, v, b) * x64[4]).sum(), argnums=(0, 1, 2, 3)
        )(*x64[:4])
    assert rel_err(out, want_out) <= 2e-6
    assert not np.asarray(out[1, 7:]).any()  # padding outputs 0
    for what, a, b in zip(["q", "k", "v", "slopes"], grads, want, strict=True):
        assert rel_err(a, b) <= 2e-6, (what, rel_err(a, b))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_padding_holding_nan_reaches_nothing_and_sinks_are_refused(name):
    q, k, v = qkv(3, B=B, T=T, N=N, K=K, H=H)
    seg = jnp.asarray(SEG, jnp.int32)
    kw = dict(mask=masks.causal(), q_segment_ids=seg, kv_segment_ids=seg)
    clean = FUNCTIONS[name](q, k, v, **kw)
    poisoned = [x.at[1, 7:].set(jnp.nan) for x in (q, k, v)]
    np.testing.assert_array_equal(FUNCTIONS[name](*poisoned, **kw), clean)
    with pytest.raises(ValueError, match="sink_logits"):
        FUNCTIONS[name](q, k, v, sink_logits=jnp.zeros(N))


def test_sigmoid_weights_do_not_sum_to_one_and_softpick_may_be_all_zero():
    q, k, v = qkv(4, B=1, T=6, N=2)
    _, w = attn.sigmoid_attention(q, k, v, return_weights=True)
    assert float(w.sum(-1).min()) > 0 and float(jnp.abs(w.sum(-1) - 1).max()) > 0.05
    # Every logit 0 (e^0 - 1 = 0): softpick gives no weight at all (no attention sink).
    out, w = attn.softpick_attention(q, jnp.zeros_like(k), v, return_weights=True)
    assert not np.asarray(w).any() and not np.asarray(out).any()
