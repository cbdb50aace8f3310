"""Models: encoder padding, cross-attention, packing, gradients, MLA.

Decoding invariants are in test_decoding.py, config validation in test_config.py, weights
and head gates in test_taps.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.block import ShortConv
from models.cache import LatentCache
from models.patterns import pattern
from tests.models.common import (
    KINDS,
    MAX_LEN,
    REGISTRY,
    WIDTH,
    B,
    apply,
    extend,
    forward,
    init_enc_dec_cache,
    model_for,
    tokens,
)
from tests.util import normal, rel_err

RTOL = 1e-4  # composed float32 functions
EXACT = 1e-6  # masked contributions are exact zeros: only rounding noise is allowed

ENCODER = ("band_global_tokens", "linear_conv", "mla")  # a (causal) short conv too


def _with_padding(seq, lengths, seed):
    """``seq`` with every position past ``lengths[b]`` replaced by other tokens."""
    other = np.asarray(tokens(seed, seq.shape))
    keep = np.arange(seq.shape[1])[None, :] < np.asarray(lengths)[:, None]
    return jnp.asarray(np.where(keep, np.asarray(seq), other), jnp.int32)


# ----------------------------------------------------------------------------
# Encoder


def test_encoder_padding_does_not_change_real_tokens():
    model = model_for(ENCODER, cls=models.Encoder)
    lengths = jnp.array([8, 5])
    seq = tokens(10, (B, 8))
    a = apply(model, seq, lengths=lengths)
    b = apply(model, _with_padding(seq, lengths, 11), lengths=lengths)
    assert a.shape == (B, 8, 32) and a.dtype == jnp.float32
    np.testing.assert_allclose(a[0], b[0], rtol=EXACT, atol=EXACT)
    np.testing.assert_allclose(a[1, :5], b[1, :5], rtol=EXACT, atol=EXACT)
    # ... and equal the unpadded row (global token 5 lies in the padding of row 1).
    alone = apply(model, seq[1:, :5])
    assert rel_err(a[1, :5], alone[0]) <= RTOL


def test_encoder_packing_equals_each_sequence_alone():
    """Bidirectional packing: band, global tokens, linear (with a short conv) and MLA layers
    stay in their segment."""
    model = model_for(ENCODER, cls=models.Encoder)
    a, b = tokens(13, (1, 3)), tokens(14, (1, 5))
    packed = jnp.concatenate([jnp.concatenate([a, b], 1), jnp.concatenate([b, a], 1)], 0)
    seg = jnp.asarray([[1] * 3 + [2] * 5, [1] * 5 + [2] * 3], jnp.int32)
    out = apply(model, packed, segment_ids=seg, positions=models.packed_positions(seg))
    # Alone: each sequence right-padded in its own row (the compile of the padding test).
    alone = apply(model, packed.at[0, 3:].set(packed[1, 3:]), lengths=jnp.array([3, 5]))
    assert rel_err(out[0, :3], alone[0, :3]) <= RTOL
    assert rel_err(out[0, 3:], alone[1, :5]) <= RTOL
    assert rel_err(out[1, :5], alone[1, :5]) <= RTOL
    assert rel_err(out[1, 5:], alone[0, :3]) <= RTOL


def test_encoder_is_bidirectional():
    model = model_for(ENCODER, cls=models.Encoder)
    seq = tokens(12, (B, 8))
    changed = seq.at[:, -1].set((seq[:, -1] + 1) % 32)
    a, b = apply(model, seq), apply(model, changed)
    assert rel_err(a[:, 0], b[:, 0]) > 1e-3  # the first token sees the last one


def test_encoder_rejects_what_it_cannot_honor():
    model = model_for(ENCODER, cls=models.Encoder)
    seg = jnp.ones((B, 8), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens(0, (B, 8)), segment_ids=seg, lengths=jnp.array([8, 8]))
    with pytest.raises(ValueError, match="lengths"):
        model(tokens(0, (B, 8)), lengths=jnp.array([9, 1]))
    with pytest.raises(ValueError, match=r"config\.layers\[0\]\.decay"):
        models.Encoder(models.ModelConfig(layers=pattern(("linear_decay",))), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("cls", "names", "field"),
    [
        (models.Encoder, ("mha", "window"), r"config\.layers\[1\]\.window"),  # a causal span
        (models.Decoder, ("band",), r"config\.layers\[0\]\.radius"),  # a bidirectional one
        (models.EncoderDecoder, ("band",), r"config\.layers\[0\]\.radius"),
    ],
)
def test_window_is_causal_and_radius_bidirectional(cls, names, field):
    kw = {"encoder_layers": pattern(("band",))} if cls is models.EncoderDecoder else {}
    with pytest.raises(ValueError, match=field):
        cls(models.ModelConfig(layers=pattern(names), **kw), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"encoder_layers\[0\]\.window"):
        models.ModelConfig(encoder_layers=pattern(("streaming",)))


# ----------------------------------------------------------------------------
# Encoder-decoder (cross-attention, T != S)

ENC_DEC = dict(encoder_layers=pattern(("mha", "linear"), REGISTRY))
ENC_DEC_LAYERS = ("gqa", "streaming")
S_SRC, T_TGT = 7, 5


def _enc_dec():
    return model_for(ENC_DEC_LAYERS, cls=models.EncoderDecoder, **ENC_DEC)


def test_cross_attention_source_padding_and_lengths():
    model = _enc_dec()
    src, tgt = tokens(20, (B, S_SRC)), tokens(21, (B, T_TGT))
    src_lengths = jnp.array([7, 4])
    a = apply(model, src, tgt, src_lengths=src_lengths)
    assert a.shape == (B, T_TGT, 32)
    b = apply(model, _with_padding(src, src_lengths, 22), tgt, src_lengths=src_lengths)
    np.testing.assert_allclose(a, b, rtol=EXACT, atol=EXACT)
    alone = apply(model, src[1:, :4], tgt[1:])
    assert rel_err(a[1], alone[0]) <= RTOL
    # The source matters.
    c = apply(model, src.at[:, 0].set((src[:, 0] + 1) % 32), tgt, src_lengths=src_lengths)
    assert rel_err(a, c) > 1e-4


def test_encoder_decoder_prefill_and_decode_match_forward():
    model = _enc_dec()
    src, seq = tokens(23, (B, S_SRC)), tokens(24, (B, MAX_LEN))
    src_lengths = jnp.array([6, 3])
    full = apply(model, src, seq, src_lengths=src_lengths)
    cache = init_enc_dec_cache(model, src, src_lengths)
    logits, cache = extend(model, seq[:, :5], cache, jnp.array([5, 5]))
    assert rel_err(logits, full[:, :5]) <= RTOL
    for t in range(5, 9):
        logits, cache = extend(model, seq[:, t : t + 1], cache)
        assert rel_err(logits[:, 0], full[:, t]) <= RTOL
    out = models.generate(
        model,
        seq[:, :5],
        4,
        cache=init_enc_dec_cache(model, src, src_lengths),
    )
    greedy = apply(model, src, jnp.concatenate([seq[:, :5], out], 1), src_lengths=src_lengths)
    np.testing.assert_array_equal(out, jnp.argmax(greedy[:, 4:-1], -1))
    with pytest.raises(ValueError, match="cache"):
        models.generate(model, seq[:, :5], 4)


def test_cross_attention_weights_and_empty_source():
    model = _enc_dec()
    src, tgt = tokens(25, (B, S_SRC)), tokens(26, (B, T_TGT))
    logits, weights = apply(model, src, tgt, src_lengths=jnp.array([7, 0]), capture=True)
    assert np.isfinite(np.asarray(logits)).all()
    N = model.config.cross.num_heads
    for w in weights["cross"]:
        assert w.shape == (B, N, T_TGT, S_SRC)
        np.testing.assert_allclose(w[0].sum(-1), 1.0, rtol=1e-6)
        np.testing.assert_array_equal(w[1], 0.0)  # a source of length 0: nothing visible
    enc = weights["encoder"]  # mha, linear
    assert all(w.shape == (B, 4, S_SRC, S_SRC) for w in enc)
    np.testing.assert_array_equal(enc[1][1], 0.0)  # linear: padding rows are 0
    assert all(w.shape == (B, 4, T_TGT, T_TGT) for w in weights["decoder"])


# ----------------------------------------------------------------------------
# Packing: several sequences in one row (segment ids, positions restarting)

PACKED = [
    ("gqa", KINDS["gqa"]),
    ("mla", KINDS["mla"]),
    ("linear_decay_gated", ("linear_decay", "linear_gated")),
    ("hybrid", KINDS["hybrid"]),  # short convs; streaming: absolute initial tokens
    ("delta", KINDS["delta"]),
    ("delta_hybrid", KINDS["delta_hybrid"]),
    ("scores", KINDS["scores"]),
    ("diff", KINDS["diff"]),
    ("ssm_hybrid", KINDS["ssm_hybrid"]),  # Mamba-2, DeltaProduct
    ("sparse", KINDS["sparse"]),  # MoBA, NSA, DSA: blocks restart with each sequence
    ("families2025", KINDS["families2025"]),  # PaTH, RWKV-7, log-linear: restart per segment
    ("ttt", KINDS["ttt"]),  # the inner model restarts, on its own mini-batch grid
]


@pytest.mark.parametrize(("kind", "names"), PACKED, ids=[k for k, _ in PACKED])
def test_packed_rows_equal_each_sequence_alone(kind, names):
    model = model_for(names)
    a, b = tokens(43, (1, 3)), tokens(44, (1, 5))
    pad, junk = tokens(45, (1, 2)), tokens(46, (1, 7))
    # Row 0 packs a, padding (id 0), then b; row 1 b, a, then padding. Alone, each
    # sequence is the prefix of a row.
    packed = jnp.concatenate([jnp.concatenate([a, pad, b], 1), jnp.concatenate([b, a, pad], 1)])
    seg = jnp.asarray([[1] * 3 + [0] * 2 + [2] * 5, [1] * 5 + [2] * 3 + [0] * 2], jnp.int32)
    positions = models.packed_positions(seg)
    np.testing.assert_array_equal(positions[0], [0, 1, 2, 0, 1, 0, 1, 2, 3, 4])
    out = apply(model, packed, segment_ids=seg, positions=positions)
    alone = apply(model, jnp.concatenate([jnp.concatenate([a, junk], 1), packed[1:]], 0))
    assert rel_err(out[0, :3], alone[0, :3]) <= RTOL, kind
    assert rel_err(out[0, 5:], alone[1, :5]) <= RTOL, kind
    assert rel_err(out[1, :5], alone[1, :5]) <= RTOL, kind
    assert rel_err(out[1, 5:8], alone[0, :3]) <= RTOL, kind


def test_short_conv_starts_as_the_identity():
    """At initialization a layer with a short conv computes what it would without one."""
    conv = ShortConv(4, 6, dtype=jnp.float32, param_dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 6)), jnp.float32)
    np.testing.assert_array_equal(conv(x), x)
    y, state = conv.extend(x, conv.init_state(2), jnp.array([5, 3]))
    np.testing.assert_array_equal(y[0], x[0])
    np.testing.assert_array_equal(y[1, :3], x[1, :3])
    np.testing.assert_array_equal(y[1, 3:], 0.0)  # padding outputs 0
    np.testing.assert_array_equal(state[1], x[1, :3])  # the last W-1 real inputs


def test_decoder_argument_errors():
    model = model_for(KINDS["gqa"])
    packed = tokens(46, (1, 8))
    with pytest.raises(ValueError, match="positions"):
        model(packed, positions=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(packed, segment_ids=jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="tokens"):
        model(jnp.zeros((B, 4)))


# ----------------------------------------------------------------------------
# MLA: the absorbed (latent-space) computation equals the naive one


@pytest.mark.parametrize("name", ["mla", "mla_direct_q_gated"])
def test_mla_absorbed_equals_naive(name):
    cfg = dataclasses.replace(REGISTRY[name], window=5, initial_tokens=1)
    layer = models.LatentAttention(
        cfg, WIDTH, causal=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(1)
    )
    x = normal(33, (B, 9, WIDTH))
    seg = jnp.asarray([[1] * 9, [1] * 4 + [2] * 5], jnp.int32)
    pos = jnp.asarray([list(range(9)), list(range(4)) + list(range(5))], jnp.int32)
    naive, (w_naive,) = models.capture_weights(layer, x, positions=pos, segment_ids=seg)
    absorbed, (w_absorbed,) = models.capture_weights(
        layer, x, positions=pos, segment_ids=seg, absorbed=True
    )
    assert rel_err(absorbed, naive) <= 1e-5
    assert rel_err(w_absorbed, w_naive) <= 1e-5
    assert w_naive.shape == (B, cfg.num_heads, 9, 9)


def test_mla_cache_holds_only_the_latent():
    model = model_for(KINDS["mla"])
    cache = model.init_cache(B, MAX_LEN)
    layer = model.config.layers[0]
    c = cache.layers[0]
    assert isinstance(c, LatentCache)
    assert c.c_kv.shape == (B, MAX_LEN, layer.kv_rank)
    assert c.k_rope.shape == (B, MAX_LEN, layer.rope_head_dim)


# ----------------------------------------------------------------------------
# Jit, gradients, dtypes


def test_jitted_forward_equals_eager():
    model = model_for(KINDS["gqa"])
    seq = tokens(40, (B, 8))
    assert rel_err(forward(model, seq), model(seq)) <= 1e-5


@pytest.mark.parametrize("kind", ["hybrid", "gqa"])
def test_gradients_flow_to_every_parameter(kind):
    model = model_for(KINDS[kind])
    seq = tokens(41, (B, 10))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(seq[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, seq[:, 1:, None], -1))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert np.isfinite(float(value))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g = np.asarray(g)
        assert np.isfinite(g).all(), path
        assert np.abs(g).sum() > 0, path


def test_untied_head_and_bf16():
    model = model_for(("mqa", "linear"), tied_embeddings=False, dtype="bfloat16")
    assert model.head is not None
    logits = forward(model, tokens(42, (B, 6)))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    f32 = model_for(("mqa", "linear"), tied_embeddings=False)
    # Same float32 parameters (same seed); only the compute dtype differs.
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(f32, nnx.Param)),
        strict=True,
    ):
        assert a.dtype == jnp.float32 and np.array_equal(a, b)
    # The float32 model (highest matmul precision) stands in for a float64
    # reference: measured 3.9e-7 from a float64 forward of the same weights.
    # The bf16 model is 9.5e-3 from float64 (and from float32) here; 9.7e-3 on
    # average and 1.4e-2 at most (jitted, as here) over 4 model seeds x 4 token
    # draws. The error is bf16's own rounding, not a missing upcast (norm,
    # softmax, rope, linear-attention and head statistics are float32): the
    # weights rounded to bf16 for the matmuls alone give 6.5e-3 (float32
    # compute), the bf16 activations alone 7.6e-3, adding up in quadrature over
    # ~20 roundings in two layers. The lower bound checks that it computes in bf16.
    err = rel_err(logits, forward(f32, tokens(42, (B, 6))))
    assert 1e-3 < err <= 1.5e-2


def test_projections_on_rows_and_fused_equal_nnx_linear():
    # Dense computes on [B*T, D] rows and fused() concatenates kernels: both are the
    # same maps as nnx.Linear on [B,T,D], value and gradient (float64 reference).
    from models.heads import Dense, fused

    rngs = nnx.Rngs(0)
    layers = [Dense(8, n, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs, use_bias=False)
              for n in (8, 4, 4)]  # fmt: skip
    x = normal(1, (2, 5, 8))

    def reference(kernels, x):
        x = np.asarray(x, np.float64)
        return [np.einsum("btd,df->btf", x, np.asarray(k, np.float64)) for k in kernels]

    kernels = [layer.kernel[...] for layer in layers]
    want = reference(kernels, x)
    for got in (tuple(layer(x) for layer in layers), fused(x, *layers)):
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and rel_err(g, w) < 1e-6

    def loss(stack):
        return sum(jnp.sum(jnp.sin(y)) for y in fused(x, *stack))

    grads = nnx.grad(loss)(nnx.List(layers))
    x64 = np.asarray(x, np.float64)
    for k, g in zip(kernels, (grads[i]["kernel"][...] for i in range(3)), strict=True):
        y = np.einsum("btd,df->btf", x64, np.asarray(k, np.float64))
        assert rel_err(g, np.einsum("btd,btf->df", x64, np.cos(y))) < 1e-5


def test_hidden_states_are_the_residual_stream_the_logits_read():
    model = model_for(KINDS["mha"])
    toks = tokens(0, (B, 8))
    h = model.hidden_states(toks)
    assert h.shape == (len(KINDS["mha"]) + 1, B, 8, WIDTH)
    assert rel_err(model._logits(h[-1]), model(toks)) <= 1e-6
    assert rel_err(h[0], model._embed(toks)) == 0.0
    with pytest.raises(ValueError, match="tokens"):
        model.hidden_states(jnp.full((B, 4), 99))  # past the vocabulary of 32
