"""Gated attention (``output_gate``, Qiu et al. 2025): the layer against the paper's formula in
float64, and the gate on every softmax kind's output.

Decoding, packing and paged serving of gated layers ride on the model tests' kinds
(``tests/models/common.py``: GQA's second layer gated per channel, MLA's per head); the ring
on ``tests/models/test_ring_models.ring_model_config`` (gated, in the fake-device tier).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.heads import QK_NORM_EPS
from tests.models.common import REGISTRY, WIDTH, B
from tests.util import normal, rel_err

T = 9


def make(cfg, seed=0, causal=True):
    kind = models.KINDS[cfg.kind]
    return kind.module(cfg, WIDTH, causal=causal, dtype=jnp.float32, param_dtype=jnp.float32,
                       rngs=nnx.Rngs(seed))  # fmt: skip


def rms(x, scale):
    """Qwen3's q/k norm of ``x [..., H]``: an RMSNorm over H with ``scale [H]``."""
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + QK_NORM_EPS) * scale


def paper_gated(p, x, N, K, H):
    """The paper's gated layer (G1: after SDPA, gate from the layer's input), causal GQA
    without positions: ``(softmax(q k^T / sqrt(H)) v * sigmoid(x W_g)) W_o``; ``p`` the
    kernels by name, with q and k through ``rms`` where ``p`` has their norms' scales
    (Qwen3-Next's layer). Any float dtype (float64 under ``jax.enable_x64``)."""
    q = (x @ p["q"]).reshape(B, T, N, H)
    k = (x @ p["k"]).reshape(B, T, K, H)
    if "q_scale" in p:
        q, k = rms(q, p["q_scale"]), rms(k, p["k_scale"])
    k = jnp.repeat(k, N // K, axis=2)
    v = jnp.repeat((x @ p["v"]).reshape(B, T, K, H), N // K, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)
    gate = jax.nn.sigmoid(x @ p["g"]).reshape(B, T, N, -1)
    return (out * gate).reshape(B, T, N * H) @ p["o"]


@pytest.mark.parametrize(("gate", "qk_norm"), [("elementwise", True), ("headwise", False)])
def test_the_gated_layer_is_the_papers_formula_with_its_gradients(gate, qk_norm):
    N, K, H = 4, 2, 8
    cfg = models.SoftmaxConfig(num_heads=N, num_kv_heads=K, head_dim=H, rope=False,
                               output_gate=gate, qk_norm=qk_norm)  # fmt: skip
    layer = make(cfg, seed=1)
    assert layer.out_gate.kernel.shape == (WIDTH, N * H if gate == "elementwise" else N)
    x, ct = normal(2, (B, T, WIDTH)), normal(3, (B, T, WIDTH))
    projections = {"q": layer.q_proj, "k": layer.k_proj, "v": layer.v_proj,
                   "g": layer.out_gate, "o": layer.o_proj}  # fmt: skip
    norms = {"q_scale": layer.q_head_norm, "k_scale": layer.k_head_norm} if qk_norm else {}
    for seed, norm in enumerate(norms.values()):  # scales away from 1, as training leaves them
        norm.scale.set_value(1.0 + 0.3 * normal(10 + seed, (H,)))

    def loss(layer, x):
        return jnp.sum(layer(x) * ct)

    y = nnx.jit(lambda m, x: m(x))(layer, x)
    grads, dx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(layer, x)
    with jax.enable_x64():
        p64 = {n: jnp.asarray(m.kernel[...], jnp.float64) for n, m in projections.items()}
        p64 |= {n: jnp.asarray(m.scale[...], jnp.float64) for n, m in norms.items()}
        x64, ct64 = jnp.asarray(x, jnp.float64), jnp.asarray(ct, jnp.float64)
        want = paper_gated(p64, x64, N, K, H)
        want_p, want_x = jax.grad(lambda p, x: jnp.sum(paper_gated(p, x, N, K, H) * ct64),
                                  argnums=(0, 1))(p64, x64)  # fmt: skip
    assert rel_err(y, want) <= 1e-5
    assert rel_err(dx, want_x) <= 1e-4
    for name in projections:
        got = getattr(grads, {"q": "q_proj", "k": "k_proj", "v": "v_proj", "g": "out_gate",
                              "o": "o_proj"}[name]).kernel[...]  # fmt: skip
        assert rel_err(got, want_p[name]) <= 1e-4, name
    for name, attr in (("q_scale", "q_head_norm"), ("k_scale", "k_head_norm"))[: len(norms)]:
        assert rel_err(getattr(grads, attr).scale[...], want_p[name]) <= 1e-4, name


# Every module that attends by softmax over masked keys, and the implementations a layer runs
# on a CPU (the Pallas kernels take no interpreter from a layer: the gate multiplies what any
# implementation returns, in the one place every call of the layer goes through).
GATED = {  # each kind with one of the two gates: both gates meet every path between them
    "dense": (dataclasses.replace(REGISTRY["gqa"], impl="dense"), "elementwise"),
    "blockwise": (dataclasses.replace(REGISTRY["gqa"], impl="blockwise", window=4), "headwise"),
    "xla": (dataclasses.replace(REGISTRY["gqa"], impl="xla"), "elementwise"),
    "mla": (REGISTRY["mla"], "headwise"),
    "diff": (REGISTRY["diff_window_gqa"], "elementwise"),
    "moba": (REGISTRY["moba_small"], "headwise"),
    "nsa": (REGISTRY["nsa_small"], "elementwise"),
    "dsa": (REGISTRY["dsa_small"], "headwise"),
    "sigmoid": (REGISTRY["sigmoid"], "elementwise"),
}


@pytest.mark.parametrize("name", list(GATED))
def test_a_zero_gate_halves_every_softmax_kinds_output(name):
    """With ``W_g = 0`` every gate is sigmoid(0) = 1/2, so the gated layer gives exactly
    half of the same layer without the gate (the output projection is linear): the gate
    sits after the attention of every kind and implementation, before ``o_proj``."""
    cfg, gate = GATED[name]
    plain = make(cfg)
    gated = make(dataclasses.replace(cfg, output_gate=gate))
    nnx.update(gated, nnx.state(plain))  # the same weights, out_gate apart
    gated.out_gate.kernel.set_value(jnp.zeros_like(gated.out_gate.kernel[...]))
    x = normal(4, (B, 8, WIDTH))
    y_plain, y_gated = nnx.jit(lambda a, b, x: (a(x), b(x)))(plain, gated, x)
    assert rel_err(y_gated, 0.5 * y_plain) <= 1e-6
    assert plain.out_gate is None


def test_cross_attention_gates_by_its_queries_input():
    cfg = models.SoftmaxConfig(num_heads=4, head_dim=8, rope=False, output_gate="headwise")
    layer = models.CrossAttention(cfg, WIDTH, dtype=jnp.float32, param_dtype=jnp.float32,
                                  rngs=nnx.Rngs(0))  # fmt: skip
    x, memory = normal(5, (B, T, WIDTH)), normal(6, (B, 5, WIDTH))
    cache = layer.memory(memory, jnp.ones((B, 5), jnp.int32))
    y = layer(x, cache)
    layer.out_gate.kernel.set_value(jnp.zeros_like(layer.out_gate.kernel[...]))
    half = layer(x, cache)
    layer.out_gate = nnx.data(None)
    assert rel_err(half, 0.5 * layer(x, cache)) <= 1e-6 and rel_err(y, half) > 1e-3


@pytest.mark.parametrize("value", ["channel", True, 1])
def test_a_bad_output_gate_is_named(value):
    with pytest.raises(ValueError, match=r"^output_gate: expected one of \('elementwise'"):
        models.SoftmaxConfig(output_gate=value)
    with pytest.raises(ValueError, match=r"^output_gate: expected"):
        models.LatentConfig(output_gate=value)


def test_the_preset_gates_per_channel():
    cfg = models.presets()["gated_mha"]
    assert cfg.kind == "softmax" and cfg.output_gate == "elementwise"
    assert models.presets()["gated_mha_conv"].output_gate == "elementwise"
