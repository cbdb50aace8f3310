"""DSA (lightning indexer + top-k tokens) and its indexer loss against naive float64 references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import dot_product_attention, masks, scores
from attn.sparse import indexed_topk_attention, indexer_loss, indexer_scores, lightning_indexer
from tests.attn.sparse import reference as ref
from tests.util import normal, qkv, rel_err

RTOL, GRAD_RTOL = 1e-5, 1e-4
B, T, N, K, H, I, F = 2, 40, 4, 2, 8, 6, 5
TOP_K = 7
MASK = masks.causal()


def inputs(seed=0):
    seg, pos = ref.packed_rows(T, B)
    q, k, v = (ref.with_nan_padding(x, seg) for x in qkv(seed, B=B, T=T, N=N, K=K, H=H))
    iw = np.abs(np.asarray(normal((seed, 3), (B, T, I)))) + 0.1  # few exact ties at 0
    index = (normal((seed, 4), (B, T, I, F)), normal((seed, 5), (B, T, F)), jnp.asarray(iw))
    rows = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    vis = ref.visibility(MASK, pos, pos, seg, seg)
    return (q, k, v), index, rows, vis


def test_indexer_is_the_papers_sum():
    _, index, _, _ = inputs()
    assert rel_err(lightning_indexer(*index), ref.dsa_scores(*index)) <= RTOL


def test_selection_scores_are_exact_and_the_same_bits_in_any_batch_chunk_or_cache():
    _, index, _, _ = inputs()
    iq, ik, iw = index
    got = np.asarray(indexer_scores(*index))
    assert rel_err(got, ref.dsa_selection_scores(*index)) <= 1e-6
    np.testing.assert_array_equal(indexer_scores(iq[1:], ik[1:], iw[1:])[0], got[1])  # alone
    np.testing.assert_array_equal(indexer_scores(iq[:, 9:10], ik, iw[:, 9:10]), got[:, 9:10])
    np.testing.assert_array_equal(indexer_scores(iq, ik[:, :13], iw), got[..., :13])


def test_decode_picks_what_the_forward_pass_picks_at_ties():
    """Tokens share 3 indexer keys, up to a few ulps (near ties), and a decode step computes
    the indexer's inputs up to a few ulps of the forward pass's (other shapes, other rounding): each
    query alone, against a longer cache, still reads what it reads in the forward pass."""
    S, t_len = 30, 24
    q, k, v = qkv(9, B=1, T=t_len, S=S, N=N, K=K, H=H)
    ik = np.asarray(normal(10, (3, F)))[np.arange(S) % 3][None]
    iq, iw = np.asarray(normal(12, (1, t_len, I, F))), np.abs(normal(13, (1, t_len, I))) + 0.1
    ik, jitter = _ulp(ik, 14), lambda x, seed: jnp.asarray(_ulp(x, seed))
    forward = indexed_topk_attention(q, k[:, :t_len], v[:, :t_len], iq, ik[:, :t_len], iw,
                                     top_k=5, chunk=16, mask=MASK)  # fmt: skip
    for t in range(t_len):
        step = indexed_topk_attention(
            q[:, t : t + 1], k, v, jitter(iq[:, t : t + 1], t), jitter(ik, (t, 1)),
            jitter(iw[:, t : t + 1], (t, 2)), top_k=5, mask=MASK,
            q_positions=jnp.full((1, 1), t, jnp.int32),
        )  # fmt: skip
        assert rel_err(step, forward[:, t : t + 1]) <= 1e-6, t


def _ulp(x, seed):
    """``x`` times ``1 + e``, ``e`` up to ``2**-20`` (a few ulps: another rounding)."""
    e = np.random.default_rng(seed).uniform(-1, 1, np.shape(x)) * 2.0**-20
    return np.asarray(x * (1 + e), np.float32)


def test_matches_the_naive_reference_forward_and_gradients():
    (q, k, v), index, rows, vis = inputs()
    reads = ref.dsa_reads(ref.dsa_selection_scores(*index), vis, TOP_K)
    assert 0.2 < reads.sum() / vis.sum() < 0.8
    ct = np.random.default_rng(1).standard_normal((B, T, N, H))
    want, want_grads = ref.float64_grads(lambda *a: ref.attend(*a, reads, **rows), (q, k, v), ct)

    def fast(q, k, v):
        return indexed_topk_attention(q, k, v, *index, top_k=TOP_K, chunk=16, mask=MASK, **rows)

    out, vjp = jax.vjp(fast, *(jnp.asarray(x) for x in (q, k, v)))
    grads = vjp(jnp.asarray(ct, jnp.float32))
    assert np.isfinite(out).all() and rel_err(out, want) <= RTOL
    for name, got, w in zip("qkv", grads, want_grads, strict=True):
        assert np.isfinite(got).all() and rel_err(got, np.nan_to_num(w)) <= GRAD_RTOL, name


def naive_loss(q, k, iq, ik, iw, reads):
    """``KL(p || softmax(I))`` over ``reads [B,T,S]``, p the heads' summed attention (renormalized),
    averaged over queries that read something (DeepSeek-V3.2's indexer loss)."""
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    G = N // K
    s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, G, axis=2)) * H**-0.5
    s = jnp.where(reads[:, None], s, -jnp.inf)
    p = jnp.where(reads[:, None], jax.nn.softmax(s, -1), 0.0).sum(1)
    p = p / jnp.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1.0)
    idx = jnp.einsum("bti,btis->bts", iw, jax.nn.relu(jnp.einsum("btif,bsf->btis", iq, ik)))
    log_q = jax.nn.log_softmax(jnp.where(reads, idx, -jnp.inf), -1)
    kl = jnp.where(reads, p * (jnp.log(jnp.where(reads, p, 1.0)) - log_q), 0.0).sum(-1)
    counted = reads.any(-1)
    return jnp.where(counted, kl, 0.0).sum() / counted.sum()


@pytest.mark.parametrize("top_k", [None, TOP_K], ids=["dense-warmup", "sparse"])
def test_indexer_loss_matches_the_naive_kl_and_trains_only_the_indexer(top_k):
    (q, k, _), index, rows, vis = inputs()
    reads = vis if top_k is None else ref.dsa_reads(ref.dsa_selection_scores(*index), vis, top_k)
    q, k = (np.nan_to_num(x) for x in (q, k))
    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, *index)]
        want, want_grads = jax.value_and_grad(
            lambda *a: naive_loss(*a, jnp.asarray(reads)), argnums=range(5)
        )(*args)

    def fast(*a):
        return indexer_loss(*a, top_k=top_k, chunk=16, mask=MASK, **rows)

    got, grads = jax.value_and_grad(fast, argnums=range(5))(
        *(jnp.asarray(x) for x in (q, k, *index))
    )
    assert abs(float(got) - float(want)) <= RTOL * abs(float(want)) and float(got) > 0
    assert not np.asarray(grads[0]).any() and not np.asarray(grads[1]).any()  # detached
    for name, g, w in zip(
        ("index_q", "index_k", "index_w"), grads[2:], want_grads[2:], strict=True
    ):
        assert rel_err(g, w) <= GRAD_RTOL, name


def test_top_k_over_every_token_is_dense_attention():
    q, k, v = qkv(3, B=B, T=T, N=N, K=K, H=H)
    _, index, _, _ = inputs()
    extra = dict(
        score_mod=scores.alibi(scores.alibi_slopes(N)),
        softcap=3.0,
        sink_logits=np.linspace(-1, 1, N, dtype=np.float32),
    )
    for mask in (masks.causal(), masks.sliding_window(12), masks.full()):
        want = dot_product_attention(q, k, v, mask=mask, **extra)
        got = indexed_topk_attention(q, k, v, *index, top_k=T, chunk=16, mask=mask, **extra)
        assert rel_err(got, want) <= RTOL, mask


def test_bad_input():
    (q, k, v), (iq, ik, iw), _, _ = inputs()
    with pytest.raises(ValueError, match="top_k"):
        indexed_topk_attention(q, k, v, iq, ik, iw, top_k=0)
    with pytest.raises(ValueError, match="index_k"):
        indexed_topk_attention(q, k, v, iq, ik[:, :5], iw, top_k=4)
    with pytest.raises(ValueError, match="index_k/index_w"):
        indexed_topk_attention(q, k, v, iq, ik[..., :2], iw, top_k=4)
    with pytest.raises(ValueError, match="mask"):
        indexer_loss(q, k, iq, ik, iw, mask=jnp.ones((T, T), bool))
    long = jnp.zeros((B, T, I, 1025))  # past the exact 8-bit dot product (1024 terms)
    with pytest.raises(ValueError, match=r"^index_q: expected a last axis of at most 1024"):
        indexed_topk_attention(q, k, v, long, jnp.zeros((B, T, 1025)), iw, top_k=4)


def test_bf16_gradients_of_keys_read_by_many_queries_are_summed_in_float32():
    # Every query of one 256-query chunk reads every earlier key: a key's gradient sums up
    # to 256 parts. Summed in bf16 (the gathered keys' dtype) dk was 2.1e-2 off the float32
    # computation on the same values; summed in float32 and rounded once, 2.9e-3.
    T = 256
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(3, B=1, T=T, N=2, K=1, H=32))
    index = (jnp.ones((1, T, 1, 4)), jnp.ones((1, T, 4)), jnp.ones((1, T, 1)))
    ct = normal(4, (1, T, 2, 32))

    def grads(q, k, v):
        def loss(q, k, v):
            out = indexed_topk_attention(q, k, v, *index, top_k=T, chunk=T, mask=MASK)
            return (out.astype(jnp.float32) * ct).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    low = grads(q, k, v)
    want = grads(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, got, w in zip("qkv", low, want, strict=True):
        assert got.dtype == jnp.bfloat16 and rel_err(got.astype(jnp.float32), w) < 4e-3, name
