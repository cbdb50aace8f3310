"""The PaTH layer: its composition, its weights, its cache, its config.

Decoding (chunked prefill + steps == forward), packing, batch invariance and
serving run with every other kind's in ``test_decoding``, ``test_models``,
``test_batch_invariance`` and ``test_serving`` (``common.KINDS["families2025"]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attn
import models
from models.cache import KVCache
from models.path import PathCache
from tests.util import rel_err

WIDTH, T = 16, 7


def layer(**fields):
    cfg = models.PathConfig(num_heads=4, num_kv_heads=2, head_dim=4, block_size=4, **fields)
    return models.PathAttention(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )


def test_the_layer_is_its_composition_and_its_weights_give_its_output():
    """PaTH-FoX written out (low-rank w, conv + SiLU, unit w, beta = 2 sigmoid, log sigmoid
    gates, the naive form); the captured weights are causal softmax rows that give it."""
    m = layer(forget_gate=True, w_rank=3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, T, WIDTH)), jnp.float32)

    @nnx.jit  # one program: eager scans compile piece by piece
    def run(m, x):
        raw = attn.short_conv(m.w_proj(m.w_down(x)), m.w_taps[...])[0]
        w = jax.nn.silu(raw).reshape(2, T, 2, 4)
        w = w / jnp.sqrt(jnp.sum(w * w, -1, keepdims=True) + 1e-6)
        beta = 2 * jax.nn.sigmoid(m.beta_proj(x))
        log_f = jax.nn.log_sigmoid(m.forget_proj(x))
        q, k, v = (p(x).reshape(2, T, -1, 4) for p in (m.q_proj, m.k_proj, m.v_proj))
        out = attn.path_attention(q, k, v, w, beta, log_forget=log_f, form="naive")
        return m(x), m.o_proj(out.reshape(2, T, 16)), out, v, models.capture_weights(m, x)

    y, want, out, v, (got, weights) = run(m, x)
    assert rel_err(y, want) <= 1e-5
    assert rel_err(got, want) <= 1e-5
    (weights,) = weights
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(weights * np.triu(np.ones((T, T)), 1), 0.0)
    v_rep = jnp.repeat(v, 2, axis=2)  # each kv head read by G = 2 query heads
    assert rel_err(jnp.einsum("bnts,bsne->btne", weights, v_rep), out) <= 1e-5


def test_a_paged_model_keeps_path_caches_whole():
    """Every PaTH step rewrites the row's keys, so its cache is never paged (a softmax
    layer beside it is), and the keys stay float32 in a bf16 model."""
    layers = (models.PathConfig(num_heads=2, head_dim=4), models.SoftmaxConfig(num_heads=2))
    config = models.ModelConfig(vocab_size=8, width=8, layers=layers, dtype="bfloat16")
    model = models.Decoder(config, rngs=nnx.Rngs(0))
    cache = jax.eval_shape(lambda: model.init_cache(2, 8, page_size=4))
    path, softmax = cache.layers
    assert isinstance(path, PathCache) and not path.paged and path.k.shape == (2, 8, 2, 4)
    assert path.k.dtype == jnp.float32 and path.v.dtype == jnp.bfloat16
    assert isinstance(softmax, KVCache) and softmax.paged


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(rope=True), "rope"),
        (dict(form="chunkwise"), "form"),
        (dict(block_size=0), "block_size"),
        (dict(w_rank=0), "w_rank"),
        (dict(w_conv=-1), "w_conv"),
        (dict(forget_gate=1), "forget_gate"),
    ],
)
def test_bad_config_is_named(fields, field):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        models.PathConfig(**fields)


def test_an_encoder_refuses_path():
    with pytest.raises(ValueError, match="causal layer for 'path'"):
        models.PathAttention(
            models.PathConfig(), 8, causal=False, dtype=jnp.float32,
            param_dtype=jnp.float32, rngs=nnx.Rngs(0),
        )  # fmt: skip
