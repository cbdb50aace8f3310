"""Taps: captured attention weights, per-head gates and head importance (models.taps)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import attn
import models
from models.heads import HeadGate
from models.taps import attention_modules
from tests.models.common import KINDS, REGISTRY, WIDTH, B, forward, model_for, tokens
from tests.util import normal, rel_err

HYBRID = KINDS["hybrid"]  # linear (decay, gates), mla, streaming; short convs


def test_captured_weights_are_the_attention_weights():
    model = model_for(HYBRID)
    T = 12
    seq = tokens(30, (B, T))
    plain = forward(model, seq)
    logits, weights = forward(model, seq, capture=True)
    np.testing.assert_allclose(logits, plain, rtol=1e-6, atol=1e-6)
    assert len(weights) == 3
    pos = np.arange(T)
    for layer, w in zip(model.config.layers, weights, strict=True):
        assert w.shape == (B, layer.num_heads, T, T) and w.dtype == jnp.float32
        # Causal rows sum to 1 (linear: up to the normalizer's eps).
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
        allowed = (
            np.asarray(layer.mask(True).allowed(pos, pos))
            if layer.kind != "linear"
            else (pos[:, None] >= pos[None, :])
        )
        np.testing.assert_array_equal(np.asarray(w)[..., ~allowed], 0.0)
    # Off by default: a plain call (under nnx.jit, which writes state changes back to
    # the model) leaves nothing on the model and the same graph.
    graph = nnx.graphdef(model)
    nnx.jit(lambda model, seq: model(seq))(model, seq)
    assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))
    assert nnx.graphdef(model) == graph
    assert not any(m.sow_weights for m in attention_modules(model))


def _layer(cls, cfg, seed=0):
    return cls(
        cfg,
        WIDTH,
        causal=True,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(seed),
    )


def test_softmax_weights_equal_dense_weights_recomputed():
    cfg = dataclasses.replace(REGISTRY["gqa_gated_softcap_sinks"], window=4)  # a mask too
    layer = _layer(models.SelfAttention, cfg)
    x = normal(34, (B, 7, WIDTH))
    y, (w,) = nnx.jit(models.capture_weights)(layer, x)  # under nnx.jit
    q, k, v = layer._qkv(x, jnp.arange(7))
    _, expected = attn.dot_product_attention(
        q,
        k,
        v,
        mask=cfg.mask(True),
        softcap=cfg.softcap,
        sink_logits=layer.sink_logits[...],
        return_weights=True,
    )
    assert rel_err(w, expected) <= 1e-6
    assert rel_err(y, layer(x)) <= 1e-6
    assert not jax.tree.leaves(nnx.state(layer, nnx.Intermediate)) and not layer.sow_weights


@jax.jit
def _linear_weights_and_output(state, x):
    layer = nnx.merge(*state)
    _, (w,) = models.capture_weights(layer, x)
    _, ctx = layer._front(x, jnp.arange(x.shape[1]), None)
    p = layer._inputs(x, None, ctx)
    return w, p["v"], layer._mix(p, **layer._options())


def test_linear_weights_times_values_are_the_output():
    cfg = dataclasses.replace(REGISTRY["linear_gated"], decay="retnet")  # decay and gates
    layer = _layer(models.LinearAttention, cfg)
    w, v, out = _linear_weights_and_output(nnx.split(layer), normal(35, (B, 7, WIDTH)))
    assert rel_err(jnp.einsum("BNTS,BSNE->BTNE", w, v), out) <= 1e-5


@jax.jit
def _delta_weights_and_output(state, x):
    layer = nnx.merge(*state)
    _, (w,) = models.capture_weights(layer, x)
    q, k, v = layer._split(attn.short_conv(layer.qkv_proj(x), layer.conv[...])[0])
    beta, log_g = layer._beta_and_gates(x)
    return w, v, attn.delta_rule(q, k, v, beta, log_gates=log_g, chunk_size=4)


def test_delta_weights_times_values_are_the_delta_rule_output():
    """The delta rule is linear in v: the captured M gives ``out = M V`` (before the norm)."""
    cfg = dataclasses.replace(REGISTRY["kda"], value_heads=8, chunk_size=4)
    layer = _layer(models.DeltaAttention, cfg)
    w, v, out = _delta_weights_and_output(nnx.split(layer), normal(36, (B, 7, WIDTH)))
    assert w.shape == (B, 8, 7, 7)
    np.testing.assert_array_equal(np.asarray(w)[..., ~np.tril(np.ones((7, 7), bool))], 0.0)
    assert rel_err(jnp.einsum("BNTS,BSNE->BTNE", w, v), out) <= 1e-5


def test_zeroing_a_gate_removes_that_heads_contribution():
    """Gates act on each head's output before the (linear) output projection."""
    layer = _layer(models.SelfAttention, REGISTRY["gqa"])
    N = layer.cfg.num_heads
    x = normal(32, (B, 6, WIDTH))
    full = layer(x)
    np.testing.assert_array_equal(models.head_gates(layer)[0], np.ones(N))
    alone = []
    for n in range(N):
        models.set_head_gates(layer, jnp.eye(N)[n : n + 1])
        alone.append(layer(x))
    models.set_head_gates(layer, jnp.ones((1, N)).at[0, 2].set(0.0))
    assert rel_err(layer(x), full - alone[2]) <= 1e-5
    assert rel_err(sum(alone), full) <= 1e-5


def test_head_gates_and_importance():
    model = nnx.clone(model_for(HYBRID))  # the cached model stays ungated
    seq = tokens(31, (B, 8))
    L, N = 3, 4
    plain = forward(model, seq)
    models.set_head_gates(model, jnp.ones((L, N)).at[1, 0].set(0.0))
    assert rel_err(forward(model, seq), plain) > 1e-4
    np.testing.assert_array_equal(jnp.stack(models.head_gates(model))[1], [0, 1, 1, 1])
    models.set_head_gates(model, [jnp.ones(N)] * L)
    np.testing.assert_allclose(forward(model, seq), plain, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="gates"):
        models.set_head_gates(model, jnp.ones((L, N + 1)))
    with pytest.raises(ValueError, match="gates"):
        models.set_head_gates(model, [jnp.ones(N)] * 2)
    with pytest.raises(ValueError, match="which"):
        models.head_gates(model, "cross")

    # Gradient-based head importance: d loss / d gate, finite and nonzero in every layer.
    def loss(model, seq):
        return jnp.sum(jax.nn.log_softmax(model(seq))[..., 0])

    grads = nnx.jit(models.head_importance, static_argnums=1)(model, loss, seq)
    grads = np.asarray(jnp.stack(grads))
    assert grads.shape == (L, N) and np.isfinite(grads).all()
    assert (np.abs(grads).sum(-1) > 0).all()
    np.testing.assert_array_equal(jnp.stack(models.head_gates(model)), np.ones((L, N)))


def test_head_gates_are_not_trained():
    model = nnx.clone(model_for(KINDS["mha"]))
    optimizer = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
    assert not jax.tree.leaves(nnx.state(optimizer.opt_state, HeadGate))
    seq = tokens(47, (B, 6))

    def loss(model):
        return jnp.mean(model(seq) ** 2)

    @nnx.jit
    def step(model, optimizer):
        optimizer.update(model, nnx.grad(loss)(model))

    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    step(model, optimizer)
    after = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    np.testing.assert_array_equal(jnp.stack(models.head_gates(model)), 1.0)
