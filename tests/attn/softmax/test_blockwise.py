"""Blockwise (FlashAttention) attention computes the dense reference's function.

Forward, lse and the gradients w.r.t. q, k, v (and sink logits) are compared with
``attn.dot_product_attention`` in float32, and bfloat16 inputs with a float64
oracle. Block sizes are small (16 and 32) so every case crosses several blocks,
and lengths are chosen not to be multiples of them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from attn.merge import merge_attention, merge_partials
from attn.softmax import blockwise
from attn.softmax.blockwise import blockwise_attention, count_blocks
from tests.util import np_attention, rel_err

TOL = 1e-5  # float32, the same function computed in another order
BF16_TOL = 1e-2
BQ, BK = 16, 32


def normal(seed, shape, dtype=jnp.float32):
    # NumPy, not jax.random: XLA compiles the generator anew for every shape (seconds each).
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def qkv(seed, B=2, T=8, S=None, N=4, K=None, H=8, dtype=jnp.float32):
    """Random q ``[B,T,N,H]``, k ``[B,S,K,H]``, v ``[B,S,K,H]`` (like tests.util.qkv)."""
    S, K = S or T, K or N
    return tuple(
        normal(seed * 3 + i, shape, dtype)
        for i, shape in enumerate([(B, T, N, H), (B, S, K, H), (B, S, K, H)])
    )


def both(q, k, v, *, block_q=BQ, block_k=BK, sink_logits=None, **kw):
    """Outputs, lse and gradients (q, k, v and sink logits) of blockwise and dense."""
    cot = normal(99, q.shape[:3] + v.shape[3:])
    lse_cot = normal(98, q.shape[:3])

    def run(fn):
        def loss(q, k, v, sink):
            out, lse = fn(q, k, v, sink_logits=sink, return_lse=True, **kw)
            # Finite lse entries carry a cotangent too: the lse is an output.
            lse_term = jnp.where(jnp.isfinite(lse), lse * lse_cot, 0.0).sum()
            return (out.astype(jnp.float32) * cot).sum() + lse_term, (out, lse)

        argnums = (0, 1, 2) if sink_logits is None else (0, 1, 2, 3)
        grad = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))
        grads, (out, lse) = grad(q, k, v, sink_logits)
        return out, lse, grads

    flash = lambda *a, **k: blockwise_attention(*a, block_q=block_q, block_k=block_k, **k)  # noqa: E731
    return run(flash), run(attn.dot_product_attention)


def assert_matches_dense(q, k, v, tol=TOL, **kw):
    (out, lse, grads), (want, want_lse, want_grads) = both(q, k, v, **kw)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert rel_err(out, want) <= tol
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    assert rel_err(lse[seen], want_lse[seen]) <= tol
    for g, want_g in zip(grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(g, np.float32)).all()
        assert rel_err(g, want_g) <= tol
    return out, grads


# One shape for most cases: T = S = 37 crosses 3 query and 2 key blocks, neither divides it.
SHAPE = dict(B=2, T=37, N=4, K=2, H=8)

MASKS = {
    "full": masks.full(),
    "causal": masks.causal(),
    "window": masks.sliding_window(9),
    "streaming": masks.causal() & (masks.sliding_window(7) | masks.initial_tokens(3)),
    "chunked": masks.causal() & masks.chunked(12),
    "global": masks.global_tokens((0, 20)) | masks.sliding_window(5),
    "bidirectional_band": masks.bidirectional_window(6),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masks_forward_lse_and_gradients(name):
    q, k, v = qkv(1, **SHAPE)
    assert_matches_dense(q, k, v, mask=MASKS[name])


@pytest.mark.parametrize(("N", "K"), [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_mha_and_mqa(N, K):
    q, k, v = qkv(2, B=2, T=37, N=N, K=K, H=8)
    assert_matches_dense(q, k, v, mask=masks.causal())


def test_softcap_scale_and_sink_logits_with_their_gradient():
    q, k, v = qkv(3, **SHAPE)
    q = 3 * q  # large logits, so the cap matters
    sink_logits = jnp.array([0.5, -1.0, 2.0, 0.0])
    _, grads = assert_matches_dense(
        q, k, v, mask=masks.causal(), softcap=2.5, scale=0.3, sink_logits=sink_logits
    )
    assert np.abs(np.asarray(grads[3])).min() > 0  # every sink logit gets a gradient


def test_one_kv_head_per_tile(monkeypatch):
    # Long sequences split the B*K kv heads into groups of tiles (TILE_SCORES);
    # one head per tile exercises the grouping with GQA, sink logits and segment ids.
    monkeypatch.setattr(blockwise, "TILE_SCORES", 1)
    q, k, v = qkv(20, **SHAPE)
    seg = jnp.asarray(np.r_[np.full(20, 1), np.full(17, 2)], jnp.int32)[None].repeat(2, 0)
    assert_matches_dense(
        q, k, v, mask=MASKS["streaming"], sink_logits=jnp.array([0.5, -1.0, 2.0, 0.0]),
        softcap=4.0, q_segment_ids=seg, kv_segment_ids=seg,
    )  # fmt: skip
    c = count_blocks(q, k, v, mask=masks.causal(), block_q=16, block_k=16)
    assert (c.full, c.partial) == (3, 3)  # blocks, not tiles: the same for every head group


def test_sink_gradient_by_finite_differences():
    # An independent check of d loss / d sink = -sum_rows P_sink * (D - d_lse).
    q, k, v = qkv(4, B=1, T=20, N=2, K=1, H=8)
    cot = normal(5, (1, 20, 2, 8))

    @jax.jit
    def f(s):
        out = blockwise_attention(q, k, v, mask=masks.causal(), sink_logits=s, block_q=8, block_k=8)
        return (out * cot).sum()

    sink_logits = jnp.array([0.3, -0.7])
    g = jax.jit(jax.grad(f))(sink_logits)
    eps = 1e-2
    for n in range(2):
        e = jnp.zeros(2).at[n].set(eps)
        fd = (f(sink_logits + e) - f(sink_logits - e)) / (2 * eps)
        assert abs(float(g[n]) - float(fd)) <= 1e-3 * max(1.0, abs(float(fd)))


def test_segment_ids_padding_packing_and_fully_masked_rows():
    q, k, v = qkv(6, **SHAPE)
    # Row 0: three packed segments and trailing padding (id 0), which sees nothing;
    # query segment 9 has no key at all. Row 1: one segment, right padding.
    q_seg = np.concatenate([np.full(10, 1), np.full(15, 2), np.full(7, 9), np.full(5, 0)])
    kv_seg = np.concatenate([np.full(10, 1), np.full(15, 2), np.full(7, 3), np.full(5, 0)])
    q_seg = jnp.asarray(np.stack([q_seg, np.r_[np.full(30, 1), np.full(7, 0)]]), jnp.int32)
    kv_seg = jnp.asarray(np.stack([kv_seg, np.r_[np.full(30, 1), np.full(7, 0)]]), jnp.int32)
    kw = dict(mask=masks.causal(), q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    out, (gq, _, _) = assert_matches_dense(q, k, v, **kw)
    dead = np.asarray(q_seg) == 0  # padding sees no key, and segment 9 has none
    dead[0, 25:32] = True
    assert not np.asarray(out)[dead].any()
    assert not np.asarray(gq)[dead].any()
    _, lse = blockwise_attention(q, k, v, block_q=BQ, block_k=BK, return_lse=True, **kw)
    assert np.isneginf(np.asarray(lse)[dead]).all()


def test_traced_positions_and_segment_ids_classify_at_run_time():
    # Under jit the schedule comes from each block's min/max position and segment id.
    q, k, v = qkv(7, B=2, T=20, S=45, N=4, K=2, H=8)
    q_pos = jnp.stack([jnp.arange(25, 45), jnp.arange(10, 30)])  # chunked prefill, per row
    kv_seg = jnp.asarray(np.r_[np.full(20, 1), np.full(25, 2)])[None].repeat(2, 0)
    q_seg = jnp.full((2, 20), 2)
    mask = masks.causal() & masks.sliding_window(16)

    def f(fn, q_pos, q_seg, kv_seg):
        return fn(q, k, v, mask=mask, q_positions=q_pos, q_segment_ids=q_seg, kv_segment_ids=kv_seg)

    flash = lambda *a, **kw: blockwise_attention(*a, block_q=8, block_k=8, **kw)  # noqa: E731
    got = jax.jit(lambda *a: f(flash, *a))(q_pos, q_seg, kv_seg)
    assert rel_err(got, f(attn.dot_product_attention, q_pos, q_seg, kv_seg)) <= TOL
    # Concrete arguments give a NumPy schedule; traced ones the run-time one: same work.
    kw = dict(mask=mask, block_q=8, block_k=8)
    static = count_blocks(
        q, k, v, q_positions=q_pos, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kw
    )
    traced = jax.jit(
        lambda p, a, b: count_blocks(
            q, k, v, q_positions=p, q_segment_ids=a, kv_segment_ids=b, **kw
        )
    )(q_pos, q_seg, kv_seg)
    assert (int(traced.full), int(traced.partial)) == (static.full, static.partial)
    assert static.full + static.partial < static.total  # blocks were skipped


def test_chunked_prefill_t_ne_s_with_explicit_positions():
    q, k, v = qkv(8, B=2, T=21, S=70, N=4, K=2, H=8)
    q_pos = jnp.arange(49, 70)  # the last 21 of 70 positions
    assert_matches_dense(q, k, v, mask=masks.causal(), q_positions=q_pos)


def test_single_query_decoding():
    q, k, v = qkv(9, B=2, T=1, S=45, N=4, K=2, H=8)
    assert_matches_dense(q, k, v, mask=masks.causal(), q_positions=jnp.array([44]))


@pytest.mark.parametrize("T", [1, 7, 129])
def test_lengths_that_are_not_multiples_of_the_blocks(T):
    q, k, v = qkv(10, B=1, T=T, N=2, K=1, H=8)
    assert_matches_dense(q, k, v, mask=masks.causal())
    assert_matches_dense(q, k, v)  # full: padding keys are the only masked ones


def test_long_sequence_at_small_heads():
    q, k, v = qkv(11, B=1, T=1000, N=2, K=1, H=4)
    assert_matches_dense(q, k, v, mask=masks.causal(), block_q=64, block_k=128)


def test_bfloat16_within_1e_2_of_float64():
    q, k, v = qkv(12, B=2, T=37, N=4, K=2, H=8, dtype=jnp.bfloat16)
    mask = masks.causal()
    allowed = mask.allowed(jnp.arange(37)[None], jnp.arange(37)[None])
    (out, _, grads), _ = both(q, k, v, mask=mask)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, np_attention(q, k, v, allowed)) <= BF16_TOL
    # Gradients: against the dense reference on the same (bf16-valued) inputs in float32.
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, (_, _, want) = both(*f32, mask=mask)
    for g, w in zip(grads, want, strict=True):
        assert g.dtype == jnp.bfloat16
        assert rel_err(g, w) <= BF16_TOL


def test_bfloat16_with_a_scale_that_is_not_a_power_of_two():
    q, k, v = qkv(13, B=1, T=37, N=2, K=1, H=6, dtype=jnp.bfloat16)  # scale 1/sqrt(6)
    allowed = masks.causal().allowed(jnp.arange(37)[None], jnp.arange(37)[None])
    out = blockwise_attention(q, k, v, mask=masks.causal(), block_q=BQ, block_k=BK)
    assert rel_err(out, np_attention(q, k, v, allowed)) <= BF16_TOL


def count(T, S, mask, block, **kw):
    q, k, v = qkv(0, B=1, T=T, S=S, N=1, H=4)
    return count_blocks(q, k, v, mask=mask, block_q=block, block_k=block, **kw)


@pytest.mark.parametrize("n", [1, 9])
def test_causal_computes_n_n_plus_1_over_2_blocks(n):
    c = count(16 * n, 16 * n, masks.causal(), 16)
    assert c.full + c.partial == n * (n + 1) // 2
    assert c.partial == n  # only the diagonal evaluates the mask
    assert c.total == n * n


def test_full_blocks_skip_the_mask_and_padding_blocks_do_not():
    c = count(64, 64, masks.full(), 16)
    assert (c.full, c.partial) == (16, 0)
    c = count(64, 70, masks.full(), 16)  # the last key block holds padding
    assert (c.full, c.partial) == (16, 4)


def test_sliding_window_work_is_linear_in_t():
    w, block = 32, 16
    for T in (256, 512, 1024):
        c = count(T, T, masks.sliding_window(w), block)
        n = T // block
        # Query block i sees key blocks i-2, i-1 and i (fewer for the first two):
        # 3n - 3 tiles, O(T w / block^2), against n^2 for the whole matrix.
        assert c.full + c.partial == 3 * n - 3
        assert c.total == n * n


def test_explicit_positions_skip_blocks_too():
    # Chunked prefill of 32 queries at the end of 128 keys: causal sees every key
    # block but the query blocks' own diagonal is partial.
    q_pos = np.arange(96, 128)
    c = count(32, 128, masks.causal(), 16, q_positions=q_pos)
    assert (c.full, c.partial) == (2 * 6 + 1, 2)
    c = count(32, 128, masks.sliding_window(16), 16, q_positions=q_pos)
    assert c.full + c.partial <= 4


@functools.partial(jax.jit, static_argnames="mask")
def partial_attention(q, k, v, q_pos, kv_pos, mask):
    """Attention of q over one key subset (traced positions: one compilation for all parts)."""
    kw = dict(q_positions=q_pos, kv_positions=kv_pos, block_q=8, block_k=8, return_lse=True)
    return blockwise_attention(q, k, v, mask=mask, **kw)


def test_merge_of_disjoint_key_sets_is_exact():
    q, k, v = qkv(14, B=2, T=23, S=48, N=4, K=2, H=8)
    mask = masks.causal()
    q_pos = jnp.arange(25, 48)  # chunked prefill: early queries cannot see late keys
    want, want_lse = attn.dot_product_attention(
        q, k, v, mask=mask, q_positions=q_pos, return_lse=True
    )
    parts = np.random.default_rng(0).permutation(48).reshape(4, 12)  # random disjoint key sets
    outs, lses = [], []
    for idx in parts:
        out, lse = partial_attention(q, k[:, idx], v[:, idx], q_pos, jnp.asarray(idx), mask)
        outs.append(out)
        lses.append(lse)
    out, lse = merge_partials(outs, lses)
    assert rel_err(out, want) <= TOL
    assert rel_err(lse, want_lse) <= TOL
    out2, lse2 = merge_attention(
        *merge_attention(outs[0], lses[0], outs[1], lses[1]), outs[2], lses[2]
    )
    out2, lse2 = merge_attention(out2, lse2, outs[3], lses[3])
    assert rel_err(out2, want) <= TOL
    assert rel_err(lse2, want_lse) <= TOL
    out3, _ = merge_partials(jnp.stack(outs), jnp.stack(lses))  # stacked [P, ...] form
    assert rel_err(out3, want) <= TOL


def test_merge_with_parts_that_see_nothing_has_no_nan():
    q, k, v = qkv(15, B=1, T=8, S=16, N=2, K=1, H=4)
    mask = masks.causal()
    q_pos = jnp.arange(8)
    # Keys 8..15 are all in the future of queries 0..7: that part is empty everywhere.
    early, e_lse = partial_attention(q, k[:, :8], v[:, :8], q_pos, jnp.arange(8), mask)
    late, l_lse = partial_attention(q, k[:, 8:], v[:, 8:], q_pos, jnp.arange(8, 16), mask)
    assert np.isneginf(np.asarray(l_lse)).all() and not np.asarray(late).any()
    want, want_lse = attn.dot_product_attention(q, k[:, :8], v[:, :8], mask=mask, return_lse=True)
    out, lse = merge_attention(early, e_lse, late, l_lse)
    assert rel_err(out, want) <= TOL and rel_err(lse, want_lse) <= TOL
    # Both parts empty: zeros and -inf, and finite gradients.
    out, lse = merge_attention(late, l_lse, late, l_lse)
    assert not np.asarray(out).any() and np.isneginf(np.asarray(lse)).all()
    g = jax.grad(lambda o, l: merge_attention(o, l, o, l)[0].sum(), argnums=(0, 1))(late, l_lse)
    assert all(np.isfinite(np.asarray(x)).all() for x in g)


def test_lse_equals_dense_lse():
    q, k, v = qkv(16, **SHAPE)
    for mask in (masks.causal(), masks.sliding_window(5)):
        _, lse = blockwise_attention(q, k, v, mask=mask, block_q=BQ, block_k=BK, return_lse=True)
        _, want = attn.dot_product_attention(q, k, v, mask=mask, return_lse=True)
        assert lse.dtype == jnp.float32 and lse.shape == (2, 37, 4)
        assert rel_err(lse, want) <= TOL


def test_dispatch_blockwise_and_auto():
    q, k, v = qkv(17, **SHAPE)
    want = attn.dot_product_attention(q, k, v, mask=masks.causal())
    got = attn.attention(q, k, v, impl="blockwise", mask=masks.causal(), block_q=BQ, block_k=BK)
    assert rel_err(got, want) <= TOL
    assert "blockwise" in attn.IMPLS
    assert rel_err(attn.attention(q, k, v, mask=masks.causal()), want) <= TOL
    # auto picks blockwise on CPU where it measured faster: long enough queries.
    choose = attn.dispatch.choose_impl
    long_q, short_q, one_q = (jnp.zeros((1, T, 2, 8)) for T in (128, 16, 1))
    keys = jnp.zeros((1, 4096, 2, 8))
    assert choose(long_q, keys, keys) == "blockwise"
    assert choose(short_q, keys, keys) == "dense"  # short queries: dense
    assert choose(one_q, keys, keys) == "dense"  # decoding
    assert choose(long_q, keys, keys, return_weights=True) == "dense"
    with pytest.raises(ValueError, match="return_weights"):
        attn.attention(q, k, v, impl="blockwise", return_weights=True)


def test_jit_and_vmap():
    q, k, v = qkv(18, B=2, T=20, N=2, K=1, H=4)
    f = lambda q, k, v: blockwise_attention(q, k, v, mask=masks.causal(), block_q=8, block_k=8)  # noqa: E731
    want = attn.dot_product_attention(q, k, v, mask=masks.causal())
    assert rel_err(jax.jit(f)(q, k, v), want) <= TOL
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    got = jax.vmap(f)(*stacked)
    assert (
        rel_err(got[1], attn.dot_product_attention(2 * q, 2 * k, 2 * v, mask=masks.causal())) <= TOL
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(block_q=0), "block_q"),
        (dict(block_k=2.5), "block_k"),
        (dict(mask="causal"), "mask"),
        (dict(q_segment_ids=jnp.ones((2, 37), jnp.int32)), "segment"),
        (dict(sink_logits=jnp.zeros(3)), "sink_logits"),
    ],
)
def test_bad_input(kwargs, match):
    q, k, v = qkv(19, **SHAPE)
    with pytest.raises(ValueError, match=match):
        blockwise_attention(q, k, v, **kwargs)
