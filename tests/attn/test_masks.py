"""The mask algebra: rules on positions and sound block classification."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from attn.masks import BlockKind
from tests.util import qkv, rel_err

# Masks whose classification is exact on contiguous boxes (primitives).
PRIMITIVES = {
    "full": masks.full(),
    "causal": masks.causal(),
    "window1": masks.sliding_window(1),
    "window5": masks.sliding_window(5),
    "band3": masks.bidirectional_window(3),
    "band_3_2": masks.band(3, 2),
    "band_0_4": masks.band(0, 4),
    "initial2": masks.initial_tokens(2),
    "chunked4": masks.chunked(4),
    "global": masks.global_tokens((0, 5, 6, 7, 19)),
}
# Compositions: classification must be sound (never claims EMPTY/FULL wrongly).
COMPOSED = {
    "streaming": masks.causal() & (masks.sliding_window(4) | masks.initial_tokens(3)),
    "chunked_causal": masks.causal() & masks.chunked(6),
    "longformer": masks.bidirectional_window(2) | masks.global_tokens((3, 11)),
    "causal_global": masks.causal() & (masks.sliding_window(3) | masks.global_tokens((0, 8))),
}


def brute(mask, q_lo, q_hi, k_lo, k_hi):
    q = np.arange(q_lo, q_hi + 1)
    k = np.arange(k_lo, k_hi + 1)
    return np.asarray(mask.allowed(q, k))


def random_boxes(seed, count=300, span=24):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        q_lo, k_lo = rng.integers(0, span, 2)
        q_hi, k_hi = q_lo + rng.integers(0, 8), k_lo + rng.integers(0, 8)
        yield int(q_lo), int(q_hi), int(k_lo), int(k_hi)


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_primitive_classification_is_exact(name):
    mask = PRIMITIVES[name]
    for box in random_boxes(seed=len(name)):
        ok = brute(mask, *box)
        want = (
            BlockKind.EMPTY if not ok.any() else BlockKind.FULL if ok.all() else BlockKind.PARTIAL
        )
        assert mask.classify(*box) == want, (name, box)


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_composed_classification_is_sound(name):
    mask = COMPOSED[name]
    kinds = set()
    for box in random_boxes(seed=len(name)):
        ok = brute(mask, *box)
        kind = mask.classify(*box)
        kinds.add(kind)
        if kind == BlockKind.EMPTY:
            assert not ok.any(), (name, box)
        if kind == BlockKind.FULL:
            assert ok.all(), (name, box)
    assert BlockKind.EMPTY in kinds or name == "longformer"
    assert BlockKind.PARTIAL in kinds


def test_composed_classification_skips_most_empty_boxes():
    mask = COMPOSED["streaming"]
    boxes = list(random_boxes(seed=7, count=400))
    empty = [b for b in boxes if not brute(mask, *b).any()]
    found = [b for b in empty if mask.classify(*b) == BlockKind.EMPTY]
    assert len(empty) > 50 and len(found) == len(empty)


def test_array_bounds_match_int_bounds_under_jit():
    mask = COMPOSED["causal_global"] | masks.chunked(5)
    boxes = np.array(list(random_boxes(seed=3, count=64)))
    want = np.array([mask.classify(*map(int, b)) for b in boxes])
    got = jax.jit(lambda b: mask.classify(b[:, 0], b[:, 1], b[:, 2], b[:, 3]))(jnp.asarray(boxes))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_rules_on_positions():
    q = np.arange(8)
    np.testing.assert_array_equal(masks.causal().allowed(q, q), np.tril(np.ones((8, 8), bool)))
    # Window of 3: position 5 sees exactly 3, 4, 5.
    row = np.asarray(masks.sliding_window(3).allowed(np.array([5]), q))[0]
    assert np.flatnonzero(row).tolist() == [3, 4, 5]
    row = np.asarray(masks.initial_tokens(2).allowed(np.array([6]), q))[0]
    assert np.flatnonzero(row).tolist() == [0, 1]
    row = np.asarray(masks.chunked(3).allowed(np.array([4]), q))[0]
    assert np.flatnonzero(row).tolist() == [3, 4, 5]
    g = np.asarray(masks.global_tokens([2]).allowed(q, q))
    assert g[2].all() and g[:, 2].all() and g.sum() == 8 + 8 - 1
    # Decode: one query at absolute position 100 over a cache holding 98..101.
    row = np.asarray(masks.causal().allowed(np.array([100]), np.arange(98, 102)))[0]
    assert row.tolist() == [True, True, True, False]


def test_algebra_is_hashable_and_composes():
    a = masks.causal() & (masks.sliding_window(4) | masks.initial_tokens(2))
    b = masks.causal() & (masks.sliding_window(4) | masks.initial_tokens(2))
    assert a == b and hash(a) == hash(b)
    q = np.arange(12)
    got = np.asarray(a.allowed(q, q))
    window = np.asarray(masks.sliding_window(4).allowed(q, q))
    initial = np.asarray(masks.initial_tokens(2).allowed(q, q))
    want = np.asarray(masks.causal().allowed(q, q)) & (window | initial)
    np.testing.assert_array_equal(got, want)


def test_block_schedule_counts_causal_blocks():
    for n in (1, 2, 5, 8):
        kinds = masks.block_schedule(masks.causal(), 16 * n, 16 * n, 16, 16)
        assert (kinds != BlockKind.EMPTY).sum() == n * (n + 1) // 2
        assert (kinds == BlockKind.PARTIAL).sum() == n  # only the diagonal needs the mask


def test_block_schedule_handles_ragged_edges():
    kinds = masks.block_schedule(masks.causal(), 10, 7, 4, 4, q_offset=3)
    for i, j in itertools.product(range(3), range(2)):
        q = 3 + np.arange(4 * i, min(4 * i + 4, 10))
        k = np.arange(4 * j, min(4 * j + 4, 7))
        ok = np.asarray(masks.causal().allowed(q, k))
        want = (
            BlockKind.EMPTY if not ok.any() else BlockKind.FULL if ok.all() else BlockKind.PARTIAL
        )
        assert kinds[i, j] == want


@pytest.mark.parametrize(
    ("make", "arg", "name"),
    [
        (masks.sliding_window, -1, "w"),
        (masks.sliding_window, 0, "w"),
        (masks.sliding_window, 2.5, "w"),
        (masks.initial_tokens, 0, "n"),
        (masks.chunked, True, "c"),
        (masks.bidirectional_window, -2, "radius"),
        (lambda x: masks.band(x, 0), -1, "left"),
        (lambda x: masks.band(2, x), 1.5, "right"),
        (masks.global_tokens, [], "positions"),
        (masks.global_tokens, [-1], "positions"),
        (masks.global_tokens, ["a"], "positions"),
    ],
)
def test_bad_arguments(make, arg, name):
    with pytest.raises(ValueError, match=name):
        make(arg)


def test_initial_tokens_are_a_hashable_value():
    assert masks.initial_tokens(2) == masks.initial_tokens(2)
    assert hash(masks.initial_tokens(2)) == hash(masks.initial_tokens(2))
    assert repr(masks.initial_tokens(4)) == "InitialTokens(n=4)"


def test_combining_with_a_non_mask_fails():
    with pytest.raises(ValueError, match="other"):
        masks.causal() & np.ones((2, 2), bool)


def test_segment_ids_from_lengths():
    ids = np.asarray(masks.segment_ids_from_lengths(jnp.array([3, 1]), 4))
    assert ids.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match="lengths"):
        masks.segment_ids_from_lengths(jnp.ones((2, 2)), 4)


def test_same_segment_pairs_equal_ids_and_never_padding():
    q = np.array([[1, 1, 0, 2]])
    k = np.array([[0, 1, 2, 2, 1]])
    got = np.asarray(masks.same_segment(q, k))
    want = (q[0][:, None] == k[0][None, :]) & (k[0] != masks.PADDING)[None, :]
    assert got.shape == (1, 4, 5) and (got[0] == want).all()
    assert not got[0, 2].any() and not got[0, :, 0].any()  # padding sees nothing, is unseen


def test_classify_broadcasts_over_all_four_bounds():
    lo = jnp.arange(4)
    assert masks.full().classify(lo, lo + 2, lo, lo + 1).shape == (4,)
    kinds = masks.initial_tokens(2).classify(lo[:, None], lo[:, None], lo[None, :], lo[None, :])
    assert kinds.shape == (4, 4) and kinds.dtype == jnp.int32
    assert (np.asarray(kinds) == np.where(np.arange(4) < 2, 1, 0)[None, :]).all()
    np_kinds = masks.causal().classify(np.arange(4), np.arange(4), 0, 3)
    assert np_kinds.dtype == np.int32 and np_kinds.tolist() == [2, 2, 2, 1]
    assert masks.full().classify(np.arange(3), np.arange(3), 0, 3).tolist() == [1, 1, 1]
    assert masks.causal().classify(0, 3, 4, 5) is masks.BlockKind.EMPTY


def test_masks_are_static_pytrees_through_jax_transforms():
    q, k, v = qkv(11, B=2, T=6, N=2, H=4)
    mask = masks.causal() & (masks.sliding_window(3) | masks.initial_tokens(1))
    assert jax.tree.leaves(mask) == []
    want = attn.dot_product_attention(q, k, v, mask=mask)
    # jit with the mask as an argument: no static_argnames needed; equal masks share a trace.
    traces = []

    def f(q, k, v, mask):
        traces.append(mask)
        return attn.attention(q, k, v, mask=mask)

    jitted = jax.jit(f)
    assert rel_err(jitted(q, k, v, mask), want) <= 1e-6
    jitted(q, k, v, masks.causal() & (masks.sliding_window(3) | masks.initial_tokens(1)))
    assert len(traces) == 1
    assert rel_err(jax.jit(attn.attention)(q, k, v, mask=mask), want) <= 1e-6
    # vmap over the batch with the mask unmapped, grad with the mask as an argument.
    per_row = jax.vmap(
        lambda q, k, v, m: attn.dot_product_attention(q[None], k[None], v[None], mask=m)[0],
        in_axes=(0, 0, 0, None),
    )(q, k, v, mask)
    assert rel_err(per_row, want) <= 1e-6
    g = jax.grad(lambda q, m: jnp.sin(attn.dot_product_attention(q, k, v, mask=m)).sum())(q, mask)
    g_closed = jax.grad(lambda q: jnp.sin(attn.dot_product_attention(q, k, v, mask=mask)).sum())(q)
    chex.assert_trees_all_close(g, g_closed)
    # shard_map over a one-device mesh: the mask crosses the boundary like any argument.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec("data")
    sharded = jax.shard_map(
        lambda q, k, v, m: attn.dot_product_attention(q, k, v, mask=m),
        mesh=mesh,
        in_specs=(spec, spec, spec, jax.sharding.PartitionSpec()),
        out_specs=spec,
    )(q, k, v, mask)
    assert rel_err(sharded, want) <= 1e-6


def test_band_is_jax_nn_local_window_and_our_windows():
    q, k = np.arange(12), np.arange(12)
    qq, kk = q[:, None], k[None, :]
    assert (masks.band(3, 2).allowed(q, k) == ((qq - 3 <= kk) & (kk <= qq + 2))).all()
    assert (masks.band(4, 0).allowed(q, k) == masks.sliding_window(5).allowed(q, k)).all()
    assert (masks.band(2, 2).allowed(q, k) == masks.bidirectional_window(2).allowed(q, k)).all()
