"""NSA's three gated branches against the naive reference (float64, forward and gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import dot_product_attention, masks
from attn.sparse import compressed_at_ends, compression_windows, nsa_attention
from tests.attn.sparse import reference as ref
from tests.util import normal, qkv, rel_err

RTOL, GRAD_RTOL = 1e-5, 1e-4
B, T, N, K, H = 2, 40, 4, 2, 8
SIZES = dict(
    compress_block=4,
    compress_stride=2,
    select_block=4,
    num_selected=3,
    window=6,
    initial_blocks=1,
    local_blocks=1,
)
MASK = masks.causal()


def inputs(seed=0):
    seg, pos = ref.packed_rows(T, B)
    q, k, v = (ref.with_nan_padding(x, seg) for x in qkv(seed, B=B, T=T, N=N, K=K, H=H))
    gates = jax.nn.sigmoid(normal((seed, 3), (B, T, N, 3)))
    l = SIZES["compress_block"]
    w_k, w_v = (normal((seed, i), (l, H, H)) * l**-0.5 for i in (4, 5))
    rows = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    return (q, k, v, gates, w_k, w_v), rows


def fast(q, k, v, gates, w_k, w_v, rows, **sizes):
    """The layer's use: compress each block's keys and values by a linear map, then NSA."""
    l, d = sizes["compress_block"], sizes["compress_stride"]
    win = dict(
        compress_block=l,
        compress_stride=d,
        kv_positions=rows["kv_positions"],
        kv_segment_ids=rows["kv_segment_ids"],
    )
    ck = jnp.einsum("BMCKH,CHF->BMKF", compression_windows(k, **win)[0], w_k)
    cv = jnp.einsum("BMCKH,CHF->BMKF", compression_windows(v, **win)[0], w_v)
    return nsa_attention(q, k, v, gates, ck, cv, chunk=16, mask=MASK, **sizes, **rows)


def test_matches_the_naive_reference_forward_and_gradients():
    args, rows = inputs()
    q, k, _, _, w_k, _ = args
    pos, seg = rows["kv_positions"], rows["kv_segment_ids"]
    vis = ref.visibility(MASK, pos, pos, seg, seg)
    blocks = ref.nsa_blocks(pos, seg, SIZES["compress_block"], SIZES["compress_stride"])
    keys = np.zeros((B, len(blocks), SIZES["compress_block"]), np.int64)
    in_row = np.zeros((B, len(blocks), 1, 1), bool)
    for m, (b, _, _, idx) in enumerate(blocks):
        keys[b, m], in_row[b, m] = idx, True

    def compress(x, w):  # phi over each block's keys, in the block list's order
        return jnp.where(
            in_row, jnp.einsum("BMCKH,CHF->BMKF", x[jnp.arange(B)[:, None, None], keys], w), 0.0
        )

    ck = np.asarray(compress(jnp.asarray(np.nan_to_num(k)), w_k), np.float64)
    cmp, slc, win = ref.nsa_reads(q, vis, pos, seg, pos, seg, ck, blocks, SIZES)
    assert 0.2 < slc.sum() / (vis.sum() * K) < 0.8 and cmp.any() and win.sum() < vis.sum()

    def naive(q, k, v, gates, w_k, w_v):
        # padding holds NaN: the compressed branch's reference takes no segment ids, so clear it
        q0, k0, v0 = (jnp.where(jnp.asarray(seg != 0)[..., None, None], x, 0.0) for x in (q, k, v))
        o_cmp = ref.attend(q0, compress(k0, w_k), compress(v0, w_v), cmp)
        o_slc = ref.attend(q, k, v, np.repeat(slc, N // K, axis=1), **rows)
        o_win = ref.attend(q, k, v, win, **rows)
        return sum(gates[..., i, None] * o for i, o in enumerate((o_cmp, o_slc, o_win)))

    ct = np.random.default_rng(1).standard_normal((B, T, N, H))
    want, want_grads = ref.float64_grads(naive, args, ct)
    out, vjp = jax.vjp(lambda *a: fast(*a, rows, **SIZES), *(jnp.asarray(x) for x in args))
    grads = vjp(jnp.asarray(ct, jnp.float32))
    assert np.isfinite(out).all() and rel_err(out, np.nan_to_num(want)) <= RTOL
    for name, got, w in zip(("q", "k", "v", "gates", "w_k", "w_v"), grads, want_grads, strict=True):
        assert np.isfinite(got).all() and rel_err(got, np.nan_to_num(w)) <= GRAD_RTOL, name


def test_each_branch_covering_everything_is_dense_attention():
    """Selected blocks covering every block, and the window alone, are dense attention."""
    (q, k, v, _, w_k, w_v), rows = inputs(2)
    q, k, v = (np.nan_to_num(x) for x in (q, k, v))
    one_hot = np.eye(3, dtype=np.float32)[None, None, None]
    dense = dot_product_attention(q, k, v, mask=MASK, **rows)
    window = dot_product_attention(q, k, v, mask=masks.sliding_window(SIZES["window"]), **rows)
    sizes = dict(SIZES, num_selected=10)
    slc = fast(q, k, v, jnp.broadcast_to(one_hot[..., 1], (B, T, N, 3)), w_k, w_v, rows, **sizes)
    win = fast(q, k, v, jnp.broadcast_to(one_hot[..., 2], (B, T, N, 3)), w_k, w_v, rows, **sizes)
    assert rel_err(slc, dense) <= RTOL and rel_err(win, window) <= RTOL


def test_tied_blocks_go_to_the_earlier_one_in_forward_and_decode():
    """Every compressed block has the same key (their probabilities tie exactly): the
    selection keeps the forced blocks and the earliest others, alike in the forward pass
    and in single-query decode steps against a longer cache."""
    t_len, S = 24, 28
    q, k, v = qkv(7, B=1, T=t_len, S=S, N=N, K=K, H=H)
    gates = jax.nn.sigmoid(normal(8, (1, t_len, N, 3)))
    M = S // SIZES["compress_stride"]
    ck = jnp.broadcast_to(normal(9, (1, 1, K, H)), (1, M, K, H))
    cv = normal(10, (1, M, K, H))
    kw = dict(chunk=8, mask=MASK, **SIZES)
    forward = nsa_attention(q, k[:, :t_len], v[:, :t_len], gates, ck[:, : t_len // 2],
                            cv[:, : t_len // 2], **kw)  # fmt: skip
    for t in (9, 15, 23):
        pos = dict(q_positions=jnp.full((1, 1), t, jnp.int32))
        step = nsa_attention(q[:, t : t + 1], k, v, gates[:, t : t + 1], ck, cv, **kw, **pos)
        assert rel_err(step, forward[:, t : t + 1]) <= RTOL, t


def test_compression_windows_hold_each_complete_block():
    _, rows = inputs()
    x = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32)[None, :, None, None], (B, T, 1, 1))
    win, real = compression_windows(
        x,
        compress_block=4,
        compress_stride=2,
        kv_positions=rows["kv_positions"],
        kv_segment_ids=rows["kv_segment_ids"],
    )
    starts = sorted(int(w[0, 0, 0]) for w in np.asarray(win[0])[np.asarray(real[0])])
    # row 0: sequences of 13, 17 and 6 at 0, 13 and 30: blocks start every 2 positions
    assert starts == [0, 2, 4, 6, 8, 13, 15, 17, 19, 21, 23, 25, 30, 32]
    assert (np.diff(np.asarray(win[0])[np.asarray(real[0])][..., 0, 0], axis=1) == 1).all()


def test_per_token_compressed_blocks_in_slot_layout():
    """What a decode cache keeps (the compressed block ending at each token) read back in
    slot layout equals compressing the slots' windows."""
    (_, k, *_), rows = inputs(4)
    k = jnp.nan_to_num(k)
    win = dict(compress_block=4, compress_stride=2, kv_positions=rows["kv_positions"],
               kv_segment_ids=rows["kv_segment_ids"])  # fmt: skip
    slots, real = compression_windows(k, **win)
    want = slots.sum(2)  # a stand-in compression: the block's sum
    padded = jnp.pad(k, ((0, 0), (3, 0), (0, 0), (0, 0)))
    ending = sum(padded[:, i : i + T] for i in range(4))  # the 4 keys ending at each token
    got = compressed_at_ends(ending, **win)
    assert real.any() and rel_err(got, want) <= 1e-6


def test_bad_input():
    (q, k, v, gates, *_), _ = inputs()
    ck = jnp.zeros((B, 20, K, H))
    with pytest.raises(ValueError, match="compressed_k"):
        nsa_attention(q, k, v, gates, ck[:, :5], ck, compress_block=4, compress_stride=2)
    with pytest.raises(ValueError, match="gates"):
        nsa_attention(q, k, v, gates[..., :2], ck, ck, compress_block=4, compress_stride=2)
    with pytest.raises(ValueError, match="compress_stride"):
        nsa_attention(q, k, v, gates, ck, ck, compress_block=2, compress_stride=4)
    with pytest.raises(ValueError, match="local_blocks"):
        nsa_attention(q, k, v, gates, ck, ck, compress_block=4, compress_stride=2, local_blocks=-1)
