"""The RWKV-7 layer: its paper's equations, its config, decoding and packing of the layer alone.

Decoding, batch invariance and serving of whole models with the kind run with
every other kind's in ``test_decoding``, ``test_models`` and ``test_serving``.
The layers here share one shape (``B``, ``T``, ``WIDTH``, heads), so each
jitted function compiles once.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from tests.util import rel_err

WIDTH, N, H = 16, 2, 8
B, T = 2, 8
CHUNK = 3  # T is no multiple of it: a partial last chunk


def layer(form: str = "chunkwise") -> models.Rwkv7Attention:
    """A layer whose zero-initialized LoRA factors are randomized, so they matter."""
    cfg = models.Rwkv7Config(num_heads=N, head_dim=H, form=form, chunk_size=CHUNK)
    m = models.Rwkv7Attention(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    rng = np.random.default_rng(1)
    for proj in (m.decay_up, m.iclr_up, m.gate_down):
        shape = proj.kernel[...].shape
        proj.kernel.set_value(jnp.asarray(rng.standard_normal(shape) * 0.5, jnp.float32))
    return m


def inputs(seed: int = 0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, WIDTH)), jnp.float32)


@nnx.jit
def forward(m, x, segment_ids):
    return m(x, segment_ids=segment_ids)


@nnx.jit
def extend(m, x, cache, lengths):
    return m.extend(x, cache, jnp.zeros((x.shape[0],), jnp.int32), lengths)


def paper(m: models.Rwkv7Attention, x):
    """The time mixing as the paper writes it, float64, one token at a time, with the
    state ``S [E,H]`` (value x key) of its equations. Returns ``out [B,T,D]``, the state's
    readouts ``o [B,T,N,E]`` (before the GroupNorm) and the values ``v [B,T,N,E]``."""
    f = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    mix, w0, a0, k_k, k_a, r_k = (f(p) for p in (m.mix, m.w0, m.a0, m.k_k, m.k_a, m.r_k))
    Wr, Wk, Wv, Wo = (f(p.kernel) for p in (m.r_proj, m.k_proj, m.v_proj, m.o_proj))
    Aw, Bw, Aa, Ba = (f(p.kernel) for p in (m.decay_down, m.decay_up, m.iclr_down, m.iclr_up))
    G1, G2 = f(m.gate_down.kernel), f(m.gate_up.kernel)
    gn_w, gn_b = f(m.norm_weight).reshape(N, H), f(m.norm_bias).reshape(N, H)
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    x = np.asarray(x, np.float64)
    out, reads, values = np.zeros(x.shape), np.zeros((B, T, N, H)), np.zeros((B, T, N, H))
    for b in range(B):
        S = np.zeros((N, H, H))  # [N, E, H]
        for t in range(T):
            x_t = x[b, t]
            delta = (x[b, t - 1] if t else 0.0) - x_t  # the token shift
            xr, xw, xk, xv, xa, xg = (x_t + delta * mix[i] for i in range(6))
            r, k, v = ((xs @ W).reshape(N, H) for xs, W in ((xr, Wr), (xk, Wk), (xv, Wv)))
            w = np.exp(-np.exp(-0.5) * sigmoid(w0 + np.tanh(xw @ Aw) @ Bw)).reshape(N, H)
            a = sigmoid(a0 + xa @ Aa @ Ba).reshape(N, H)
            kappa = k * k_k.reshape(N, H)
            kappa = kappa / np.linalg.norm(kappa, axis=-1, keepdims=True)
            k = k * (1 + (a - 1) * k_a.reshape(N, H))
            o = np.zeros((N, H))
            for n in range(N):
                transition = np.diag(w[n]) - np.outer(kappa[n], a[n] * kappa[n])
                S[n] = S[n] @ transition + np.outer(v[n], k[n])
                o[n] = S[n] @ r[n]
            reads[b, t], values[b, t] = o, v
            mean = o.mean(-1, keepdims=True)
            var = ((o - mean) ** 2).mean(-1, keepdims=True)
            normed = (o - mean) / np.sqrt(var + 1e-5 * H) * gn_w + gn_b
            bonus = (r * k * r_k).sum(-1, keepdims=True) * v
            g = (sigmoid(xg @ G1) @ G2).reshape(N, H)
            out[b, t] = ((normed + bonus) * g).reshape(-1) @ Wo
    return out, reads, values


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_the_layer_is_its_paper_s_equations(form):
    """Token shift, LoRAs, removal and replacement keys, the state update in the paper's
    ``[E,H]`` orientation, GroupNorm, bonus, gate and ``o_proj``: equal in float32; the
    weights tap is M of ``o = M v`` before the norm."""
    m, x = layer(form), inputs()
    want, reads, values = paper(m, x)
    assert rel_err(forward(m, x, None), want) <= 1e-5
    if form == "recurrent":
        return  # one weights tap suffices; the forms are the same function
    _, (weights,) = nnx.jit(models.capture_weights)(m, x)
    assert weights.shape == (B, N, T, T)
    np.testing.assert_array_equal(np.triu(np.asarray(weights), 1), 0.0)  # causal
    assert rel_err(np.einsum("bnts,bsne->btne", weights, values), reads) <= 1e-5


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(form="parallel"), "form"),
        (dict(rope=True), "rope"),
        (dict(num_kv_heads=1), "num_kv_heads"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(decay_rank=0), "decay_rank"),
        (dict(iclr_rank=True), "iclr_rank"),
        (dict(gate_rank=2.0), "gate_rank"),
    ],
)
def test_config_refuses_what_the_layer_cannot_take(change, field):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        models.Rwkv7Config(num_heads=2, **change)


def test_config_refuses_an_encoder_and_the_preset_is_registered():
    with pytest.raises(ValueError, match=r"^cfg\.kind: expected"):
        models.Rwkv7Attention(
            models.Rwkv7Config(), 8, causal=False, dtype=jnp.float32,
            param_dtype=jnp.float32, rngs=nnx.Rngs(0),
        )  # fmt: skip
    preset = models.presets(num_heads=3, head_dim=4, chunk_size=16)["rwkv7"]
    assert (preset.kind, preset.num_heads, preset.head_dim, preset.chunk_size) == (
        "rwkv7", 3, 4, 16,
    )  # fmt: skip
    assert models.KINDS["rwkv7"].family == "linear" and models.KINDS["rwkv7"].in_order


def test_decoding_and_packing_compute_the_forward_pass():
    """Prefill in two chunks with per-row lengths (NaN in the padding), then two steps,
    equals the forward pass; two packed segments (NaN in the padding) compute what each
    computes alone (a prefix of a row, by causality: the forward pass's first outputs)."""
    m, x = layer(), inputs()
    want = np.asarray(forward(m, x, None))
    x_np = np.asarray(x)

    cache = m.init_cache(B, T)
    got = np.full((B, T, WIDTH), np.nan)
    done = np.zeros(B, int)
    for lengths in ((4, 2), (2, 4)):  # 6 tokens per row, then 2 steps
        chunk = np.full((B, 4, WIDTH), np.nan, np.float32)
        for b, n in enumerate(lengths):
            chunk[b, :n] = x_np[b, done[b] : done[b] + n]
        y, cache = extend(m, jnp.asarray(chunk), cache, jnp.asarray(lengths, jnp.int32))
        for b, n in enumerate(lengths):
            got[b, done[b] : done[b] + n] = np.asarray(y)[b, :n]
        done += lengths
    for t in (6, 7):
        y, cache = extend(m, x[:, t : t + 1], cache, None)
        got[:, t] = np.asarray(y)[:, 0]
    assert rel_err(got, want) <= 1e-5

    packed = np.full((B, T, WIDTH), np.nan, np.float32)
    packed[0, :3], packed[0, 3:7], packed[1, :5] = x_np[0, :3], x_np[1, :4], x_np[1, :5]
    ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 3, 0, 0, 0]], jnp.int32)
    y = np.asarray(forward(m, jnp.asarray(packed), ids))
    alone = np.concatenate([want[0, :3], want[1, :4], want[1, :5]])
    assert rel_err(np.concatenate([y[0, :7], y[1, :5]]), alone) <= 1e-5
