"""The sparse kinds beyond the shared decode, packing and paging tests: their configs, the
indexer's training signal, and the weights tap."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from attn import masks
from attn.sparse import indexer_loss
from models.taps import attention_modules
from tests.models.common import KINDS, REGISTRY, WIDTH, model_for, tokens
from tests.util import normal, rel_err

T = 12


def _layer(name, seed=0, **fields):
    cfg = dataclasses.replace(REGISTRY[name], **fields)
    cls = models.KINDS.lookup(cfg.kind, "kind").module
    return cls(cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs=nnx.Rngs(seed))  # fmt: skip


def test_dsa_indexer_learns_from_its_loss_alone_and_the_model_from_its_own():
    """The gradient reaching the indexer is the indexer loss's (times its weight); the
    rest of the layer gets the gradient of its output only."""
    layer = _layer("dsa_small", indexer_loss_weight=0.5, score=None, softcap=None)
    x = normal(1, (2, T, WIDTH))
    ct = normal(2, (2, T, WIDTH))
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))

    def model_loss(layer):
        return jnp.sum(layer(x) * ct)

    def output_only(layer):  # the same output, without the indexer's loss
        q, k, v = layer._qkv(x, pos)
        q_side, kv_side = layer._token_arrays(x)
        rows = layer._whole(pos, None)
        return jnp.sum(layer._output(layer._sparse(q, k, v, q_side, kv_side, **rows,
                                                   training=False)) * ct)  # fmt: skip

    def aux(layer):
        q, k, _ = layer._qkv(x, pos)
        (iq, iw), (ik,) = layer._token_arrays(x)
        return indexer_loss(q, k, iq, ik, iw, mask=masks.causal(), q_positions=pos,
                            kv_positions=pos)  # fmt: skip

    grads = nnx.grad(model_loss)(layer)
    plain = nnx.grad(output_only)(layer)
    want = nnx.grad(aux)(layer)
    for name in ("index_q", "index_k", "index_w"):
        got, w = grads[name]["kernel"][...], 0.5 * want[name]["kernel"][...]
        assert np.abs(w).max() > 0 and rel_err(got, w) <= 1e-5, name
        assert not np.asarray(plain[name]["kernel"][...]).any(), name  # no LM gradient
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert rel_err(grads[name]["kernel"][...], plain[name]["kernel"][...]) <= 1e-6, name


def test_moba_and_dsa_weights_are_their_sparse_rows_and_nsa_refuses():
    model = model_for(KINDS["sparse"])
    layers = attention_modules(model)
    seq = tokens(3, (2, 16))
    with pytest.raises(ValueError, match="capture_weights"):
        models.capture_weights(model, seq)
    assert not any(m.sow_weights for m in layers)
    alone = model_for(("moba_small", "dsa_small"))
    _, weights = models.capture_weights(alone, seq)
    for w, keep in zip(weights, (2 * 4, 4), strict=True):  # MoBA: 2 blocks of 4; DSA: 4 tokens
        w = np.asarray(w)
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
        assert (np.triu(w[0, 0], 1) == 0).all() and ((w > 0).sum(-1) <= keep).all()
        assert ((w > 0).sum(-1)[:, :, -1] == keep).all()  # the last query reads all it may


@pytest.mark.parametrize(
    ("name", "fields", "field"),
    [
        ("moba", dict(window=8), "window"),
        ("moba", dict(top_k=0), "top_k"),
        ("moba", dict(impl="dense"), "impl"),
        ("nsa", dict(compress_stride=32), "compress_stride"),
        ("nsa", dict(local_blocks=-1), "local_blocks"),
        ("dsa", dict(indexer_loss="kl"), "indexer_loss"),
        ("dsa", dict(score="forgetting"), "score"),
    ],
)
def test_config_errors(name, fields, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(models.presets()[name], **fields)
