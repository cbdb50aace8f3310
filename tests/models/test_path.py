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


def test_the_layer_is_fla_s_composition_and_its_weights_give_its_output():
    """PaTH-FoX as fla's ``PaTHAttention`` composes it, in float64 (low-rank w, conv + SiLU,
    unit w, beta = 2 sigmoid, log sigmoid gates scaled with the logits as fla's kernel
    scales them, ``attn.softmax.reference.path_attention``); the captured weights are
    causal softmax rows that give it."""
    from attn.softmax import reference

    m = layer(forget_gate=True, w_rank=3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, T, WIDTH)), jnp.float32)
    y, (got, weights) = nnx.jit(lambda m, x: (m(x), models.capture_weights(m, x)))(m, x)

    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    dense = lambda p, a: a @ f64(p.kernel[...]) + (0 if p.bias is None else f64(p.bias[...]))  # noqa: E731
    x64 = f64(x)
    taps = f64(m.w_taps[...])
    low = dense(m.w_proj, dense(m.w_down, x64))
    raw = sum(taps[i] * np.pad(low, ((0, 0), (2 - i, 0), (0, 0)))[:, :T] for i in range(3))
    w = (raw / (1 + np.exp(-raw))).reshape(2, T, 2, 4)
    w = w / np.sqrt(np.sum(w * w, -1, keepdims=True) + 1e-6)
    beta = 2 / (1 + np.exp(-dense(m.beta_proj, x64)))
    log_f = -np.logaddexp(0, -dense(m.forget_proj, x64)) * 4**-0.5  # fla: inside the scale
    q, k, v = (dense(p, x64).reshape(2, T, -1, 4) for p in (m.q_proj, m.k_proj, m.v_proj))
    with jax.enable_x64():
        out = reference.path_attention(q, k, v, w, beta, log_f, scale=4**-0.5)
        want = dense(m.o_proj, np.asarray(out).reshape(2, T, 16))
    assert rel_err(y, want) <= 1e-5
    assert rel_err(got, want) <= 1e-5
    (weights,) = weights
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(weights * np.triu(np.ones((T, T)), 1), 0.0)
    v_rep = np.repeat(v, 2, axis=2)  # each kv head read by G = 2 query heads
    assert rel_err(np.einsum("bnts,bsne->btne", weights, v_rep), out) <= 1e-5


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
