"""The log-linear layers: each is its parent's pieces plus the level weights, unit weights
give the parent, the configs refuse what the layers cannot take, and a chunked prefill with
per-row lengths followed by steps is the forward pass.

Tiny shapes, one jitted program per call shape (compiles dominate); decoding, packing and
serving of whole models are ``tests/models/common.py``'s.
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

WIDTH, B, T = 16, 2, 7


def mamba(**fields):
    cfg = models.LogLinearMamba2Config(
        num_heads=4, head_dim=4, state_dim=6, groups=2, chunk_size=2, num_levels=3, **fields
    )
    return models.Mamba2(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )


def delta(**fields):
    cfg = models.LogLinearDeltaConfig(
        num_heads=2, head_dim=4, value_heads=4, chunk_size=2, num_levels=3, **fields
    )
    m = models.DeltaAttention(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    m.level_scale.set_value(jnp.linspace(0.5, 2.0, 12).reshape(4, 3))  # not all ones
    return m


def inputs(seed: int, length: int = T):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, length, WIDTH)), jnp.float32)


@nnx.jit
def forward(m, x, segment_ids=None):
    return m(x, segment_ids=segment_ids)


@nnx.jit
def extend(m, x, cache, lengths):
    return m.extend(x, cache, jnp.zeros((x.shape[0],), jnp.int32), lengths)


def levels_of(m, x):
    """``softplus(level_scale * (x W_level))`` written out, ``[B,T,N,L]``."""
    N, L = m.level_scale.shape
    raw = (x @ m.level_proj.kernel[...]).reshape(*x.shape[:2], N, L)
    return jax.nn.softplus(m.level_scale[...] * raw)


def mamba_written_out(m, x):
    """Mamba-2's block (``tests/models/test_mamba.py``) with log-linear attention (quadratic)."""
    z, xbc, dt_raw = np.split(np.asarray(m.in_proj(x)), [16, 16 + 16 + 24], axis=-1)
    conv = jax.nn.silu(attn.short_conv(xbc, m.conv_weight[...], m.conv_bias[...])[0])
    xs, b, c = np.split(np.asarray(conv), [16, 28], axis=-1)
    xs = xs.reshape(B, -1, 4, 4)
    dt = jax.nn.softplus(dt_raw + m.dt_bias[...])
    y = attn.log_linear_attention(
        c.reshape(B, -1, 2, 6),
        b.reshape(B, -1, 2, 6),
        xs * dt[..., None],
        dt * -jnp.exp(m.A_log[...]),
        levels_of(m, x),
        form="quadratic",
        scale=1.0,
    )
    y = (y + m.D[...][:, None] * xs).reshape(B, -1, 16)
    gated = (y * jax.nn.silu(z)).reshape(B, -1, 2, 8)
    normed = gated / np.sqrt(np.mean(np.square(gated), -1, keepdims=True) + 1e-5)
    return m.o_proj(normed.reshape(B, -1, 16) * m.norm_weight[...])


def delta_written_out(m, x):
    """Gated DeltaNet's layer (``models.delta``) with the log-linear delta rule (recurrent)."""
    mixed = jax.nn.silu(attn.short_conv(m.qkv_proj(x), m.conv[...])[0])
    q, k, v = np.split(np.asarray(mixed), [8, 16], axis=-1)
    unit = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = unit(q.reshape(B, T, 2, 4)), unit(k.reshape(B, T, 2, 4))
    beta = jax.nn.sigmoid(m.beta_proj(x))
    log_g = None
    if m.gate_proj is not None:
        raw = m.gate_proj(x) + m.dt_bias[...]
        log_g = -jnp.exp(m.A_log[...]) * jax.nn.softplus(raw)
    out = attn.log_linear_delta_rule(
        q, k, v.reshape(B, T, 4, 4), beta, levels_of(m, x), log_gates=log_g, form="recurrent"
    )
    normed = out / np.sqrt(np.mean(np.square(out), -1, keepdims=True) + 1e-6)
    normed = normed * m.out_norm.scale[...]
    gate = jax.nn.silu(m.out_gate(x)).reshape(B, T, 4, 4)
    return m.o_proj((normed * gate).reshape(B, T, 16))


@pytest.mark.parametrize(
    "build, written_out",
    [
        (mamba, mamba_written_out),
        (delta, delta_written_out),
        (lambda: delta(gate="none"), delta_written_out),
    ],
    ids=["mamba2", "gated_deltanet", "deltanet"],
)
def test_the_layer_is_its_parent_s_composition(build, written_out):
    """The layer (chunkwise, chunks of 2, 3 levels: the top one shared) equals its parent's
    pieces, the level weights ``softplus(level_scale * x W_level)`` and the attn function
    in another form, written out."""
    m, x = build(), inputs(0)
    assert rel_err(forward(m, x), written_out(m, x)) <= 1e-5


def test_unit_level_weights_give_mamba2(monkeypatch):
    """All level weights 1 is Mamba-2 itself: the same parameters (drawn first, in the same
    order) give ``Mamba2``'s output."""
    m = mamba()
    cfg = dataclasses.asdict(m.cfg)
    del cfg["kind"], cfg["num_levels"]
    parent = models.Mamba2(
        models.Mamba2Config(**cfg), WIDTH, causal=True, dtype=jnp.float32,
        param_dtype=jnp.float32, rngs=nnx.Rngs(0),
    )  # fmt: skip
    ones = lambda layer, x: jnp.ones((*x.shape[:2], 4, 3), jnp.float32)  # noqa: E731
    monkeypatch.setattr(models.mamba, "level_weights", ones)
    run = nnx.jit(lambda m, x: m(x))  # traced here, with the patch (not forward's cache)
    x = inputs(1)
    assert rel_err(run(m, x), run(parent, x)) <= 1e-5


@pytest.mark.parametrize(
    "config, change, field",
    [
        (models.LogLinearMamba2Config, dict(negative_eigenvalues=True), "negative_eigenvalues"),
        (models.LogLinearMamba2Config, dict(chunk_size=48), "chunk_size"),
        (models.LogLinearMamba2Config, dict(num_levels=0), "num_levels"),
        (models.LogLinearMamba2Config, dict(groups=3), "groups"),
        (models.LogLinearDeltaConfig, dict(gate="channel"), "gate"),
        (models.LogLinearDeltaConfig, dict(householder_steps=2), "householder_steps"),
        (models.LogLinearDeltaConfig, dict(form="quadratic"), "form"),
        (models.LogLinearDeltaConfig, dict(chunk_size=6), "chunk_size"),
    ],
)
def test_configs_refuse_what_their_layers_cannot_take(config, change, field):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        config(num_heads=4, **change)


def test_kinds_and_presets_are_registered():
    for name, module in (
        ("log_linear_mamba2", models.Mamba2),
        ("log_linear_gated_deltanet", models.DeltaAttention),
    ):
        kind = models.KINDS[name]
        assert kind.module is module and kind.family == "linear" and kind.in_order
        assert isinstance(kind.sequence_parallel, str)
        assert models.presets()[name].kind == name
    with pytest.raises(ValueError, match=r"^cfg\.kind: expected"):
        models.Mamba2(
            models.LogLinearMamba2Config(), 8, causal=False, dtype=jnp.float32,
            param_dtype=jnp.float32, rngs=nnx.Rngs(0),
        )  # fmt: skip


def test_chunked_prefill_with_lengths_and_steps_equal_the_forward():
    """Two prefill chunks of 4 with per-row lengths (row 1 has no token in the first) and
    two steps give the forward pass's outputs (chunkwise, rows ending in padding); the
    padding, NaN throughout, reaches nothing. Log-linear Gated DeltaNet here; log-linear
    Mamba-2 (chunkwise) decodes in ``test_decoding``'s ``families2025`` model."""
    m = delta()
    firsts, seconds = np.array([3, 0]), np.array([4, 2])
    totals = firsts + seconds + 2
    seq = np.asarray(inputs(2, 9))
    real = np.arange(9)[None, :] < totals[:, None]
    full = np.where(real[..., None], seq, np.nan)
    want = np.asarray(forward(m, full, real.astype(np.int32)))
    assert np.isfinite(want[real]).all()

    def chunk(start, lengths):
        x = np.full((B, 4, WIDTH), np.nan, np.float32)
        for r in range(B):
            x[r, : lengths[r]] = seq[r, start[r] : start[r] + lengths[r]]
        return x

    cache = m.init_cache(B, 16)
    got = [[] for _ in range(B)]
    for start, lengths in ((np.zeros(2, int), firsts), (firsts, seconds)):
        out, cache = extend(m, chunk(start, lengths), cache, jnp.asarray(lengths))
        for r in range(B):
            got[r].extend(np.asarray(out)[r, : lengths[r]])
    np.testing.assert_array_equal(cache.state.length, firsts + seconds)
    for i in range(2):
        at = firsts + seconds + i
        out, cache = extend(m, seq[np.arange(B), at][:, None], cache, None)
        for r in range(B):
            got[r].append(np.asarray(out)[r, 0])
    for r in range(B):
        assert rel_err(np.stack(got[r]), want[r, : totals[r]]) <= 1e-5, r


def test_captured_weights_give_the_mixer_output():
    """The weights tap is M of ``y = M x`` (before the norm): log-linear attention's masked
    matrix with D on its diagonal, causal."""
    m, x = mamba(), inputs(3)

    @nnx.jit
    def run(m, x):
        xbc, ctx = m._front(x, None, None)
        p = m._inputs(x, attn.short_conv(xbc, m.conv_weight[...], m.conv_bias[...])[0], ctx)
        y = m._mix(p, form="chunkwise", chunk_size=2)
        return y, p["x"], models.capture_weights(m, x)

    y, xs, (_, (weights,)) = run(m, x)
    assert weights.shape == (B, 4, T, T)
    assert rel_err(jnp.einsum("bnts,bsne->btne", weights, xs), y) <= 1e-5
    np.testing.assert_array_equal(weights * np.triu(np.ones((T, T)), 1), 0.0)
