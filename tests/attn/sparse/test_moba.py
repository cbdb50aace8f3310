"""MoBA against its naive reference (float64, forward and gradients), coverage, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import dot_product_attention, masks, scores
from attn.sparse import block_key_sums, moba_attention, window_key_sums
from tests.attn.sparse import reference as ref
from tests.util import qkv, rel_err

RTOL, GRAD_RTOL = 1e-5, 1e-4
B, T, N, K, H = 2, 40, 4, 2, 8


def inputs(seed=0):
    seg, pos = ref.packed_rows(T, B)
    q, k, v = (ref.with_nan_padding(x, seg) for x in qkv(seed, B=B, T=T, N=N, K=K, H=H))
    rows = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    return (q, k, v), rows


@pytest.mark.parametrize(
    ("mask", "top_k"),
    [
        (masks.causal(), 3),
        (masks.sliding_window(12), 2),
        (masks.causal() & masks.sliding_window(7), 1),
    ],
    ids=["causal", "window", "causal-window-top1"],
)
def test_matches_the_naive_reference_forward_and_gradients(mask, top_k):
    (q, k, v), rows = inputs()
    vis = ref.visibility(
        mask,
        rows["q_positions"],
        rows["kv_positions"],
        rows["q_segment_ids"],
        rows["kv_segment_ids"],
    )
    reads = ref.moba_reads(
        q,
        k,
        vis,
        rows["q_positions"],
        rows["q_segment_ids"],
        rows["kv_positions"],
        rows["kv_segment_ids"],
        block_size=4,
        top_k=top_k,
    )
    assert 0.2 < reads.sum() / (vis.sum() * N) < 0.8  # the choice matters
    ct = np.random.default_rng(1).standard_normal((B, T, N, H))
    want, want_grads = ref.float64_grads(lambda *a: ref.attend(*a, reads, **rows), (q, k, v), ct)

    def fast(q, k, v):
        return moba_attention(q, k, v, block_size=4, top_k=top_k, chunk=16, mask=mask, **rows)

    out, vjp = jax.vjp(fast, *(jnp.asarray(x) for x in (q, k, v)))
    grads = vjp(jnp.asarray(ct, jnp.float32))
    real = rows["q_segment_ids"] != 0
    assert np.isfinite(out).all() and (np.asarray(out)[~real] == 0).all()
    assert rel_err(out, want) <= RTOL
    for name, got, w in zip("qkv", grads, want_grads, strict=True):
        assert np.isfinite(got).all() and (np.asarray(got)[~real] == 0).all(), name
        assert rel_err(got, np.nan_to_num(w)) <= GRAD_RTOL, name


def test_the_gate_is_float32_and_picks_what_the_paper_picks_at_close_calls():
    """MoBA's gate is ``q . mean(k)`` in the inputs' precision (its paper, and its naive
    code): one sequence of 200 tokens, block 32, top 3, where gates at the cut come within
    1e-3 of each other (an 8-bit gate picked another block in 2 of 800 rows, wrong by 0.5
    to 2.2 relative). Every row reads the float64 reference's blocks, forward and gradients."""
    q, k, v = qkv(11, B=1, T=200, N=4, H=16)
    pos = np.arange(200)[None]
    vis = ref.visibility(masks.causal(), pos, pos, np.ones_like(pos), np.ones_like(pos))
    gaps = []
    reads = ref.moba_reads(q, k, vis, pos, np.ones_like(pos), pos, np.ones_like(pos),
                           block_size=32, top_k=3, gaps=gaps)  # fmt: skip
    assert 1e-5 < min(gaps) < 1e-3  # close calls, none a float32 rounding could flip
    ct = np.random.default_rng(1).standard_normal(q.shape)
    want, want_grads = ref.float64_grads(lambda *a: ref.attend(*a, reads), (q, k, v), ct)
    for impl in ("gather", "pallas"):

        def fast(q, k, v, impl=impl):
            kernel = dict(impl=impl, interpret=True if impl == "pallas" else None)
            return moba_attention(q, k, v, block_size=32, top_k=3, mask=masks.causal(), **kernel)

        out, vjp = jax.vjp(fast, *(jnp.asarray(x) for x in (q, k, v)))
        assert rel_err(out, want) <= RTOL, impl
        for name, got, w in zip("qkv", vjp(jnp.asarray(ct, jnp.float32)), want_grads, strict=True):
            assert rel_err(got, w) <= GRAD_RTOL, (impl, name)


def test_top_1_reads_the_own_block_before_one_a_window_cuts():
    """Query 9 (block size 4, window 7) sees keys 3 to 9: block 0 in part, its own block 2."""
    q, k, v = qkv(4, B=1, T=12, N=2, H=4)
    mask = masks.causal() & masks.sliding_window(7)
    out = moba_attention(q, k, v, block_size=4, top_k=1, mask=mask)
    own = dot_product_attention(q[:, 9:10], k[:, 8:10], v[:, 8:10])
    assert rel_err(out[:, 9:10], own) <= RTOL


def cache_sums(k, block_size):
    """The sums a decode cache keeps, key by key: each key's block up to it, in slots."""
    B, S, K, H = k.shape
    windows = np.zeros((B, S, block_size, K, H), np.float32)
    for s in range(S):
        o = s % block_size
        windows[:, s, : o + 1] = np.asarray(k[:, s - o : s + 1])
    return window_key_sums(jnp.asarray(windows))


def test_near_tied_blocks_are_chosen_alike_in_forward_and_decode():
    """Blocks 0 to 3 hold the same keys up to a few ulps (near ties) and values of their own,
    and the decode steps read the sums a cache keeps: their float32 gates are the same bits
    as the forward pass's, so every query reads the same blocks in both."""
    q, k, v = qkv(6, B=1, T=24, N=2, H=4)
    k = np.concatenate([np.tile(k[:, :4], (1, 4, 1, 1)), k[:, 16:]], axis=1)
    k = jnp.asarray(k * (1 + np.random.default_rng(1).uniform(-1, 1, k.shape) * 2.0**-20))
    kw = dict(block_size=4, top_k=2, mask=masks.causal())
    forward = moba_attention(q, k, v, chunk=8, **kw)
    sums = cache_sums(k, 4)
    ends = np.arange(3, 24, 4)  # at a block's last key the cache holds the forward's bits
    np.testing.assert_array_equal(sums[:, ends], block_key_sums(k, 4)[:, ends])
    for t in range(8, 24):
        one = dict(q_positions=jnp.full((1, 1), t, jnp.int32), key_sums=sums)
        step = moba_attention(q[:, t : t + 1], k, v, **kw, **one)
        assert rel_err(step, forward[:, t : t + 1]) <= RTOL, t


MODIFIERS = {
    "alibi": dict(score_mod=scores.alibi(scores.alibi_slopes(N))),
    "softcap+sinks": dict(softcap=2.0, sink_logits=np.linspace(-1, 1, N, dtype=np.float32)),
}


@pytest.mark.parametrize("extra", MODIFIERS.values(), ids=MODIFIERS)
def test_top_k_over_every_block_is_dense_attention(extra):
    """The coverage identity, under the masks and with the modifiers, in float32."""
    q, k, v = qkv(3, B=B, T=T, N=N, K=K, H=H)
    for mask in (masks.causal(), masks.sliding_window(12) | masks.initial_tokens(3), masks.full()):
        want = dot_product_attention(q, k, v, mask=mask, **extra)
        got = moba_attention(q, k, v, block_size=8, top_k=6, chunk=16, mask=mask, **extra)
        assert rel_err(got, want) <= RTOL, mask


def test_packed_rows_choose_within_their_sequence():
    """A packed sequence reads what it reads alone (blocks restart with it)."""
    (q, k, v), rows = inputs(5)
    got = moba_attention(q, k, v, block_size=4, top_k=2, mask=masks.causal(), **rows)
    for lo, hi in ((0, 13), (13, 30), (30, 36)):
        alone = moba_attention(
            q[:1, lo:hi], k[:1, lo:hi], v[:1, lo:hi], block_size=4, top_k=2, mask=masks.causal()
        )
        assert rel_err(got[:1, lo:hi], alone) <= RTOL


def test_key_sums_kept_by_a_cache_give_the_same_selection():
    """Each key holds its block's sum, and passing a cache's sums changes nothing."""
    (q, k, v), rows = inputs(7)
    k = np.nan_to_num(k)
    sums = block_key_sums(k, 4, kv_positions=rows["kv_positions"],
                          kv_segment_ids=rows["kv_segment_ids"])  # fmt: skip
    seg, pos = rows["kv_segment_ids"][0], rows["kv_positions"][0]
    for s in (0, 3, 4, 14, 16, 33):  # block starts, ends and middles, over three sequences
        same = (seg == seg[s]) & (pos // 4 == pos[s] // 4)
        np.testing.assert_allclose(sums[0, s], k[0, same].sum(0), rtol=1e-5, atol=1e-6)
    kw = dict(block_size=4, top_k=2, mask=masks.causal(), **rows)
    want = moba_attention(q, k, v, **kw)
    assert rel_err(moba_attention(q, k, v, key_sums=sums, **kw), want) == 0
    with pytest.raises(ValueError, match="key_sums"):
        moba_attention(q, k, v, key_sums=sums[:, :5], **kw)
    # linear in k: the gradient of <sums, ct> at key s sums ct over its block's keys
    ct = np.random.default_rng(2).standard_normal(sums.shape).astype(np.float32)
    grad = jax.grad(lambda k: jnp.sum(block_key_sums(k, 4, kv_positions=rows["kv_positions"],
                                                     kv_segment_ids=rows["kv_segment_ids"]) * ct))(
        jnp.asarray(k)
    )  # fmt: skip
    for s in (13, 15):  # the second sequence's first block: keys 13 to 16
        np.testing.assert_allclose(grad[0, s], ct[0, 13:17].sum(0), rtol=1e-5)
    with pytest.raises(ValueError, match="block_size"):
        block_key_sums(k, 0)


def test_bad_input():
    q, k, v = qkv(0, B=1, T=8, N=2, H=4)
    with pytest.raises(ValueError, match="block_size"):
        moba_attention(q, k, v, block_size=0, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        moba_attention(q, k, v, block_size=4, top_k=1.5)
    with pytest.raises(ValueError, match="bias"):
        moba_attention(q, k, v, block_size=4, top_k=2, bias=jnp.zeros((1, 1, 8, 8)))
    with pytest.raises(ValueError, match="kv_positions"):
        moba_attention(
            q,
            k,
            v,
            block_size=4,
            top_k=2,
            q_positions=np.arange(8) * 2,
            kv_positions=np.arange(8) * 2,
        )
    seg = np.array([[1, 1, 2, 2, 1, 1, 2, 2]])
    with pytest.raises(ValueError, match="kv_segment_ids"):
        moba_attention(q, k, v, block_size=4, top_k=2, q_segment_ids=seg, kv_segment_ids=seg)
