"""Key results with and without ``jax.jit`` (``chex.variants``) against float64 NumPy oracles.

Dense attention against ``np_attention``, and merging partial results over
disjoint key sets against attention over their union. Positions are always
passed explicitly, so nothing here depends on the default query alignment.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import attn
from attn import masks
from attn.merge import merge_attention, merge_partials
from tests.chex_util import VariantTestCase
from tests.util import normal, np_attention, qkv

# Elementwise, float32 results against float64 oracles on O(1) values.
RTOL, ATOL = 1e-5, 1e-6


def np_lse(q, k, allowed, scale=None):
    """Float64 ``[B,T,N]`` log-sum-exp of the visible logits; ``-inf`` where none is visible."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = np.einsum("btnh,bsnh->btns", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = np.where(np.asarray(allowed)[:, :, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (m_safe + np.log(np.exp(s - m_safe).sum(-1, keepdims=True)))[..., 0]


def batch_positions(x, B):
    return np.broadcast_to(np.asarray(x, np.int32), (B, np.shape(x)[-1]))


# ----------------------------------------------------------------------------
# Dense attention


class DenseAttentionVariantsTest(VariantTestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("causal_gqa", masks.causal(), 4, 2, {}),
        ("window_mqa", masks.sliding_window(3), 4, 1, {}),
        ("streaming_softcap",
         masks.causal() & (masks.sliding_window(4) | masks.initial_tokens(2)), 4, 2,
         {"softcap": 2.5}),
        ("longformer_mha", masks.bidirectional_window(2) | masks.global_tokens((0, 7)), 2, 2, {}),
        ("chunked_causal_scale", masks.causal() & masks.chunked(4), 4, 4, {"scale": 0.3}),
        ("full_sink_logits", masks.full(), 4, 2, {"sink_logits": np.array([0.5, -1.0, 2.0, 0.0])}),
    )  # fmt: skip
    def test_matches_numpy_oracle(self, mask, N, K, kwargs):
        B, T, S = 2, 7, 12
        q, k, v = qkv(30, B=B, T=T, S=S, N=N, K=K, H=8, E=6)
        q = 2 * q  # logits of a few units, so the softcap matters
        # Chunked prefill at per-row offsets: row 0 holds positions 5..11, row 1 0..6.
        q_pos = np.stack([np.arange(5, 12), np.arange(7)]).astype(np.int32)
        kv_pos = batch_positions(np.arange(S), B)

        @self.traced_variant
        def f(q, k, v, q_pos, kv_pos):
            return attn.dot_product_attention(
                q, k, v, mask=mask, q_positions=q_pos, kv_positions=kv_pos, return_lse=True,
                **kwargs,
            )  # fmt: skip

        out, lse = f(q, k, v, q_pos, kv_pos)
        allowed = np.asarray(mask.allowed(q_pos, kv_pos))
        chex.assert_shape(out, (B, T, N, 6))
        chex.assert_trees_all_close(
            out, np_attention(q, k, v, allowed, **kwargs), rtol=RTOL, atol=ATOL
        )
        if "sink_logits" not in kwargs and "softcap" not in kwargs:
            want_lse = np_lse(q, k, allowed, kwargs.get("scale"))
            chex.assert_trees_all_close(lse, want_lse, rtol=RTOL, atol=ATOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_segments_and_empty_rows_match_numpy_oracle(self):
        B, T = 2, 8
        q, k, v = qkv(31, B=B, T=T, N=4, K=2, H=8)
        q_seg = np.array([[1, 1, 1, 2, 2, 2, 3, 3], [1] * T], np.int32)
        kv_seg = np.array(
            [[1, 1, 1, 2, 2, 2, 0, 0], [0] * T], np.int32
        )  # segment 3, row 1: nothing
        pos = batch_positions(np.arange(T), B)

        @self.traced_variant
        def f(q, k, v, q_seg, kv_seg):
            return attn.dot_product_attention(
                q, k, v, mask=masks.causal(), q_positions=pos, kv_positions=pos,
                q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True,
            )  # fmt: skip

        out, lse = f(q, k, v, q_seg, kv_seg)
        allowed = np.asarray(masks.causal().allowed(pos, pos)) & (
            q_seg[:, :, None] == kv_seg[:, None, :]
        )
        chex.assert_trees_all_close(
            (out, lse),
            (np_attention(q, k, v, allowed), np_lse(q, k, allowed)),
            rtol=RTOL,
            atol=ATOL,
        )
        assert np.isneginf(np.asarray(lse)[1]).all() and not np.asarray(out)[1].any()


# ----------------------------------------------------------------------------
# Merging partial results


def partials(q, k, v, q_pos, parts, mask):
    """Dense attention (out, lse) over each key subset, keys keeping their positions."""
    outs, lses = [], []
    for idx in parts:
        kv_pos = batch_positions(idx, q.shape[0])
        out, lse = attn.dot_product_attention(
            q, k[:, idx], v[:, idx], mask=mask, q_positions=q_pos, kv_positions=kv_pos,
            return_lse=True,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return outs, lses


class MergeVariantsTest(VariantTestCase):
    # StreamingLLM over queries 20..25: some parts are empty for some rows.
    MASK = masks.causal() & (masks.sliding_window(8) | masks.initial_tokens(2))

    def setUp(self):
        super().setUp()
        self.q, self.k, self.v = qkv(32, B=2, T=6, S=30, N=4, K=2, H=8)
        self.q_pos = batch_positions(np.arange(20, 26), 2)
        allowed = np.asarray(self.MASK.allowed(self.q_pos, batch_positions(np.arange(30), 2)))
        self.want = (np_attention(self.q, self.k, self.v, allowed), np_lse(self.q, self.k, allowed))

    # Two parts: A = {2..17, 26..29} is empty for query 25 (its window starts at 18).
    TWO = (np.r_[2:18, 26:30], np.r_[0:2, 18:26])
    FIVE = tuple(np.array_split(np.random.default_rng(5).permutation(30), 5))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("two", TWO), ("five", FIVE))
    def test_merge_partials_is_attention_over_the_union(self, parts):
        assert sorted(np.concatenate(parts).tolist()) == list(range(30))  # disjoint, complete
        outs, lses = partials(self.q, self.k, self.v, self.q_pos, parts, self.MASK)
        assert any(np.isneginf(np.asarray(lse)).any() for lse in lses)  # some rows see nothing
        merged = self.traced_variant(merge_partials)(outs, lses)
        chex.assert_trees_all_close(merged, self.want, rtol=RTOL, atol=ATOL)
        stacked = self.traced_variant(merge_partials)(jnp.stack(outs), jnp.stack(lses))
        chex.assert_trees_all_close(stacked, self.want, rtol=RTOL, atol=ATOL)
        # Pairwise, in any order: merging is associative and commutative.
        merge = self.traced_variant(merge_attention)
        result = (outs[-1], lses[-1])
        for out, lse in zip(outs[-2::-1], lses[-2::-1], strict=True):
            result = merge(out, lse, *result)
        chex.assert_trees_all_close(result, self.want, rtol=RTOL, atol=ATOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_parts_that_see_nothing_give_zeros_and_finite_gradients(self):
        # Keys 26..29 are in every query's future: that part is empty everywhere.
        early, late = np.arange(26), np.arange(26, 30)
        (o_a, o_b), (l_a, l_b) = partials(
            self.q, self.k, self.v, self.q_pos, [early, late], self.MASK
        )
        assert np.isneginf(np.asarray(l_b)).all() and not np.asarray(o_b).any()
        merge = self.traced_variant(merge_attention)
        chex.assert_trees_all_close(merge(o_a, l_a, o_b, l_b), self.want, rtol=RTOL, atol=ATOL)
        out, lse = merge(o_b, l_b, o_b, l_b)
        chex.assert_trees_all_equal((out, lse), (jnp.zeros_like(o_b), jnp.full_like(l_b, -jnp.inf)))
        cot = normal(33, o_b.shape)
        grad = self.traced_variant(
            jax.grad(lambda o, l: (merge_attention(o, l, o, l)[0] * cot).sum(), argnums=(0, 1))
        )
        chex.assert_tree_all_finite(grad(o_b, l_b))
