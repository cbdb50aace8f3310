"""The dense reference: a worked example by hand, oracles, masking, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from tests.util import normal, np_attention, qkv, rel_err

TOL = 1e-5  # float32, simple function


def seed_example():
    """Three tokens, d_k = 2, Q = K (identity projections): small enough to do by hand."""
    x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    return x[None, :, None], x[None, :, None], v[None, :, None]


def test_seed_worked_example():
    q, k, v = seed_example()
    out, w = attn.dot_product_attention(q, k, v, return_weights=True)
    want_w = [[0.40, 0.20, 0.40], [0.20, 0.40, 0.40], [0.25, 0.25, 0.50]]
    np.testing.assert_array_equal(np.round(np.asarray(w[0, 0], np.float64), 2), want_w)
    np.testing.assert_array_equal(
        np.round(np.asarray(out[0, :, 0], np.float64), 2), [[0.6, 0.4], [0.4, 0.6], [0.5, 0.5]]
    )
    # The scaled scores by hand: 1/sqrt(2) = 0.71 and 2/sqrt(2) = 1.41.
    s = np.asarray(q[0, :, 0] @ k[0, :, 0].T, np.float64) / np.sqrt(2)
    np.testing.assert_array_equal(
        np.round(s, 2), [[0.71, 0, 0.71], [0, 0.71, 0.71], [0.71, 0.71, 1.41]]
    )


def test_seed_worked_example_gradient():
    q, k, v = seed_example()
    f = lambda q, k, v: attn.dot_product_attention(q, k, v).sum()  # noqa: E731
    g = lambda q, k, v: jnp.asarray(np_attention(q, k, v)).sum()  # noqa: E731
    grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jax.nn.dot_product_attention(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, want, strict=True):
        assert rel_err(a, b) <= TOL
    assert float(g(q, k, v)) == pytest.approx(float(f(q, k, v)), rel=1e-6)
    # Each output row is an average of values whose components sum to 1, so the
    # total is 3 whatever q and k are: the gradient w.r.t. q and k vanishes.
    np.testing.assert_allclose(np.asarray(grads[0]), 0, atol=1e-6)


def test_seed_scaling_claims():
    x = normal(0, (2, 100_000, 64))
    dots = (x[0] * x[1]).sum(-1)
    # Std of a sample std over 1e5 draws is ~8/sqrt(2e5) = 0.018: 0.1 is > 5 sigma.
    assert abs(float(dots.std()) - 8.0) < 0.1
    assert abs(float((dots / jnp.sqrt(64.0)).std()) - 1.0) < 0.0125
    np.testing.assert_array_equal(
        np.round(np.asarray(jax.nn.softmax(jnp.array([1.0, 2, 3])), np.float64), 2),
        [0.09, 0.24, 0.67],
    )
    sharp = np.asarray(jax.nn.softmax(jnp.array([8.0, 16, 24])), np.float64)
    np.testing.assert_array_equal(np.round(sharp, 4), [0.0, 0.0003, 0.9997])
    # The vanishing gradient: the Jacobian of the sharp softmax is ~0 off the winner.
    jac = np.asarray(jax.jacobian(jax.nn.softmax)(jnp.array([8.0, 16, 24])))
    assert np.abs(jac).max() < 4e-4


def test_permutation_equivariance_of_bidirectional_attention():
    q, k, v = qkv(1, B=1, T=7, N=2)
    perm = jnp.array([3, 0, 6, 1, 5, 2, 4])
    out = attn.dot_product_attention(q, k, v)
    out_p = attn.dot_product_attention(q[:, perm], k[:, perm], v[:, perm])
    assert rel_err(out_p, out[:, perm]) <= TOL
    # Permuting only keys and values together changes nothing at all.
    assert rel_err(attn.dot_product_attention(q, k[:, perm], v[:, perm]), out) <= TOL


def test_causality_forward_and_gradient():
    q, k, v = qkv(2, B=1, T=9, N=2)
    out = attn.dot_product_attention(q, k, v, mask=masks.causal())
    k2 = k.at[:, 5:].set(7.0)
    v2 = v.at[:, 5:].set(-3.0)
    out2 = attn.dot_product_attention(q, k2, v2, mask=masks.causal())
    np.testing.assert_array_equal(np.asarray(out[:, :5]), np.asarray(out2[:, :5]))
    # Output at t = 4 has zero gradient w.r.t. every later key and value.
    f = lambda k, v: attn.dot_product_attention(q, k, v, mask=masks.causal())[:, 4].sum()  # noqa: E731
    gk, gv = jax.jit(jax.grad(f, argnums=(0, 1)))(k, v)
    assert not np.asarray(gk[:, 5:]).any() and not np.asarray(gv[:, 5:]).any()
    assert np.asarray(gv[:, :5]).any()


# (N, K): MHA, GQA, MQA
HEADS = [(4, 4), (4, 2), (4, 1)]
JAX_MASKS = {
    "full": (None, {}),
    "causal": (masks.causal(), {"is_causal": True}),
    "window": (masks.sliding_window(3), {"is_causal": True, "local_window_size": (2, 0)}),
}


def grads(fn, q, k, v):
    cot = normal(9, q.shape[:3] + v.shape[3:])
    return jax.jit(jax.grad(lambda q, k, v: (fn(q, k, v) * cot).sum(), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(("N", "K"), HEADS)
@pytest.mark.parametrize("name", sorted(JAX_MASKS))
def test_matches_jax_nn(N, K, name):
    mask, kw = JAX_MASKS[name]
    q, k, v = qkv(3, B=2, T=11, N=N, K=K, H=8)
    ours = lambda q, k, v: attn.dot_product_attention(q, k, v, mask=mask)  # noqa: E731
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)  # noqa: E731
    assert rel_err(ours(q, k, v), theirs(q, k, v)) <= TOL
    for a, b in zip(grads(ours, q, k, v), grads(theirs, q, k, v), strict=True):
        assert rel_err(a, b) <= TOL


@pytest.mark.parametrize(("N", "K"), HEADS)
def test_padding_matches_jax_nn_lengths(N, K):
    q, k, v = qkv(4, B=3, T=10, N=N, K=K)
    lengths = jnp.array([10, 6, 1])
    seg = masks.segment_ids_from_lengths(lengths, 10)
    ours = lambda q, k, v: attn.dot_product_attention(  # noqa: E731
        q, k, v, mask=masks.causal(), q_segment_ids=jnp.ones_like(seg), kv_segment_ids=seg
    )
    theirs = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, key_value_seq_lengths=lengths
    )
    assert rel_err(ours(q, k, v), theirs(q, k, v)) <= TOL
    for a, b in zip(grads(ours, q, k, v), grads(theirs, q, k, v), strict=True):
        assert rel_err(a, b) <= TOL


def test_gqa_equals_mha_with_repeated_kv():
    q, k, v = qkv(5, B=2, T=6, N=6, K=2)
    k_rep, v_rep = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)
    gqa = lambda q, k, v: attn.dot_product_attention(q, k, v, mask=masks.causal())  # noqa: E731
    assert rel_err(gqa(q, k, v), gqa(q, k_rep, v_rep)) <= TOL
    gq, gk, gv = grads(gqa, q, k, v)
    hq, hk, hv = grads(gqa, q, k_rep, v_rep)
    assert rel_err(gq, hq) <= TOL
    # The grouped kv head's gradient is the sum over the query heads sharing it.
    assert rel_err(gk, hk.reshape(2, 6, 2, 3, 8).sum(3)) <= TOL
    assert rel_err(gv, hv.reshape(2, 6, 2, 3, 8).sum(3)) <= TOL


def reference(q, k, v, allowed, *, scale=None, softcap=None, sink_logits=None):
    """An independent jnp oracle: repeated K/V, a concatenated sink column, jax.nn.softmax."""
    B, T, N, H = q.shape
    rep = N // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * (scale or H**-0.5)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(allowed[:, None], s, -jnp.inf)
    if sink_logits is not None:
        sink = jnp.broadcast_to(sink_logits[None, :, None, None], (B, N, T, 1))
        s = jnp.concatenate([s, sink], -1)
    w = jax.nn.softmax(s, axis=-1)[..., : k.shape[1]]
    return jnp.einsum("bnts,bsne->btne", w, v)


def test_sink_logits_softcap_scale_and_positions_match_an_independent_oracle():
    q, k, v = qkv(6, B=2, T=5, S=12, N=4, K=2, H=8)
    q = q * 3  # large logits so the cap matters
    sink_logits = jnp.array([0.5, -1.0, 2.0, 0.0])
    q_pos = jnp.array([7, 8, 9, 10, 11])  # chunked prefill: the last 5 of 12 positions
    mask = masks.causal() & masks.sliding_window(6)
    allowed = mask.allowed(
        jnp.broadcast_to(q_pos, (2, 5)), jnp.broadcast_to(jnp.arange(12), (2, 12))
    )
    kw = dict(scale=0.3, softcap=2.5, sink_logits=sink_logits)
    ours = lambda q, k, v, s: attn.dot_product_attention(  # noqa: E731
        q, k, v, mask=mask, q_positions=q_pos, scale=0.3, softcap=2.5, sink_logits=s
    )
    theirs = lambda q, k, v, s: reference(q, k, v, allowed, scale=0.3, softcap=2.5, sink_logits=s)  # noqa: E731
    assert rel_err(ours(q, k, v, sink_logits), theirs(q, k, v, sink_logits)) <= TOL
    assert rel_err(ours(q, k, v, sink_logits), np_attention(q, k, v, allowed, **kw)) <= TOL
    cot = normal(1, (2, 5, 4, 8))
    loss = lambda f: lambda *a: (f(*a) * cot).sum()  # noqa: E731
    for a, b in zip(
        jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(q, k, v, sink_logits),
        jax.jit(jax.grad(loss(theirs), argnums=(0, 1, 2, 3)))(q, k, v, sink_logits),
        strict=True,
    ):
        assert rel_err(a, b) <= 1e-4  # composed: cap, sink logits and masking


def test_decode_query_equals_last_row_of_the_full_pass():
    q, k, v = qkv(7, B=2, T=10, N=4, K=2)
    full = attn.dot_product_attention(q, k, v, mask=masks.causal())
    last = attn.dot_product_attention(
        q[:, -1:], k, v, mask=masks.causal(), q_positions=jnp.array([9])
    )
    assert rel_err(last, full[:, -1:]) <= TOL
    # Per-row positions: rows of the batch at different lengths.
    pos = jnp.array([[4], [9]])
    rows = attn.dot_product_attention(q[:, -1:], k, v, mask=masks.causal(), q_positions=pos)
    want = attn.dot_product_attention(
        q[:1, -1:], k[:1, :5], v[:1, :5], mask=masks.causal(), q_positions=jnp.array([4])
    )
    assert rel_err(rows[:1], want) <= TOL


def test_bias_matches_jax_nn():
    q, k, v = qkv(8, B=2, T=6, N=4, K=2)
    bias = normal(3, (1, 4, 6, 6))
    ours = attn.dot_product_attention(q, k, v, bias=bias)
    assert rel_err(ours, jax.nn.dot_product_attention(q, k, v, bias=bias)) <= TOL


def test_lse_is_the_log_normalizer():
    q, k, v = qkv(9, B=1, T=4, N=2)
    _, w, lse = attn.dot_product_attention(
        q, k, v, mask=masks.causal(), return_weights=True, return_lse=True
    )
    s = jnp.einsum("btnh,bsnh->btns", q, k) * 8**-0.5
    s = jnp.where(jnp.tril(jnp.ones((4, 4), bool))[None, :, None], s, -jnp.inf)
    assert rel_err(lse, jax.nn.logsumexp(s, -1)) <= TOL
    np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fully_masked_rows_give_zeros_and_zero_gradients(dtype):
    q, k, v = qkv(10, B=2, T=6, N=2, dtype=dtype)
    q_seg = jnp.array([[1, 1, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1]])
    kv_seg = jnp.array([[1, 1, 2, 2, 0, 0], [0, 0, 0, 0, 0, 0]])  # segment 3 and row 1 see nothing
    f = lambda q, k, v: attn.dot_product_attention(  # noqa: E731
        q, k, v, mask=masks.causal(), q_segment_ids=q_seg, kv_segment_ids=kv_seg
    )
    out, w = attn.dot_product_attention(
        q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_weights=True
    )
    assert out.dtype == dtype
    dead = np.array([[0, 0, 0, 0, 1, 1], [1] * 6], bool)
    assert not np.asarray(out, np.float32)[dead].any()
    assert not np.asarray(w).transpose(0, 2, 1, 3)[dead].any()
    gq, gk, gv = grads(f, q, k, v)
    for g in (gq, gk, gv):
        assert np.isfinite(np.asarray(g, np.float32)).all()
    assert not np.asarray(gq, np.float32)[dead].any()
    assert not np.asarray(gk, np.float32)[1].any() and not np.asarray(gv, np.float32)[1].any()
    assert np.asarray(gq, np.float32)[~dead].any()


def test_bfloat16_within_1e_2_of_float64():
    q, k, v = qkv(11, B=2, T=16, N=4, K=2, H=16, dtype=jnp.bfloat16)
    out = attn.dot_product_attention(q, k, v, mask=masks.causal())
    assert out.dtype == jnp.bfloat16
    allowed = np.broadcast_to(np.tril(np.ones((16, 16), bool)), (2, 16, 16))
    assert rel_err(out, np_attention(q, k, v, allowed)) <= 1e-2


def test_float16_statistics_do_not_overflow():
    q, k, v = qkv(12, B=1, T=8, N=2, H=64, dtype=jnp.float16)
    q = q * 40  # logits ~ 40 * 8 * 8 = 2560: exp() would overflow in float16
    out = attn.dot_product_attention(q, k, v)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, np_attention(q, k, v)) <= 1e-2


def test_jit_and_vmap():
    q, k, v = qkv(13, B=2, T=5, N=2)
    f = jax.jit(lambda q, k, v: attn.dot_product_attention(q, k, v, mask=masks.causal()))
    assert rel_err(f(q, k, v), attn.dot_product_attention(q, k, v, mask=masks.causal())) <= TOL
    g = jax.vmap(lambda q, k, v: attn.dot_product_attention(q[None], k[None], v[None])[0])
    assert rel_err(g(q, k, v), attn.dot_product_attention(q, k, v)) <= TOL


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"q": jnp.ones((4, 8))}, r"q: expected a rank-4 array \[B,T,N,H\] \(or rank 3"),
        ({"q": jnp.ones((4, 4, 8))}, "k: expected rank 3 like q"),
        ({"k": jnp.ones((2, 4, 3, 8)), "v": jnp.ones((2, 4, 3, 8))}, "dividing"),
        ({"k": jnp.ones((3, 4, 2, 8)), "v": jnp.ones((3, 4, 2, 8))}, "batch"),
        ({"k": jnp.ones((2, 4, 2, 6))}, "head dim"),
        ({"v": jnp.ones((2, 5, 2, 8))}, "v: expected length 4"),
        ({"q_positions": jnp.arange(5)}, "q_positions"),
        ({"kv_positions": jnp.arange(3.0)}, "kv_positions"),
        (
            {"q_segment_ids": jnp.ones((2, 3), int), "kv_segment_ids": jnp.ones((2, 4), int)},
            "^q_segment_ids: expected",
        ),
        ({"q_segment_ids": jnp.ones((2, 4), int)}, "^q_segment_ids/kv_segment_ids: expected both"),
        ({"sink_logits": jnp.ones(2)}, "sink_logits"),
        ({"scale": -1.0}, "scale"),
        ({"softcap": 0.0}, "softcap"),
        ({"bias": jnp.ones((5, 4))}, "bias: expected a shape broadcastable"),
        ({"bias": jnp.ones((1, 3, 4, 4))}, "bias"),
        ({"bias": jnp.ones((1, 1, 1, 4, 4))}, "bias: expected an array of rank <= 4"),
        ({"bias": jnp.ones((4, 4), int)}, "bias: expected a floating-point array"),
        ({"mask": np.ones((4, 4), int)}, "mask: expected a boolean array"),
        ({"mask": np.ones((3, 4), bool)}, "mask: expected a shape broadcastable"),
        ({"mask": "causal"}, "mask: expected a boolean array"),
        ({"is_causal": 1}, "is_causal: expected a bool"),
        ({"local_window_size": (1, 2, 3)}, "local_window_size"),
        ({"local_window_size": (-1, 2)}, "left"),
        ({"query_seq_lengths": jnp.ones(3, jnp.int32)}, "query_seq_lengths: expected"),
        ({"key_value_seq_lengths": jnp.array([1.0, 2.0])}, "key_value_seq_lengths: expected"),
        ({"key_value_seq_lengths": np.array([-1, 2])}, "key_value_seq_lengths: expected len"),
        ({"empty_rows": "nan"}, "empty_rows"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"q": jnp.ones((2, 4, 4, 8)), "k": jnp.ones((2, 4, 2, 8)), "v": jnp.ones((2, 4, 2, 8))}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        attn.dot_product_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
