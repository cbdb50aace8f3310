"""Queries without positions are the last T key positions (bottom-right alignment).

A decode step (T = 1) or a prefill chunk (T < S) attends exactly like the last
T rows of the full pass, in every implementation, without passing positions.
Where that default cannot be right (T > S with a position-dependent mask) the
call raises instead of guessing.
"""

import jax
import jax.numpy as jnp
import pytest

import attn
from attn import masks
from tests.attn.impls import SMALL_FLOAT32, attend, impls_with, params
from tests.util import qkv, rel_err

TOL = 1e-5
S = 45  # not a multiple of the blocks below
BLOCKS = {"block_q": 8, "block_k": 16}
MASKS = {
    "causal": masks.causal(),
    "window": masks.sliding_window(6),
    "streaming": masks.causal() & (masks.sliding_window(6) | masks.initial_tokens(2)),
}
IMPLS = impls_with(*SMALL_FLOAT32, auto=True)  # float32, head dim 8
# The interpreted kernels' cases in the integration tier (the fast tier's time).
CASES = params(IMPLS, interpreted_in_integration=True)


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("impl", CASES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("T", [1, 7])
def test_default_queries_are_the_last_rows_of_the_full_pass(T, mask, impl):
    q, k, v = qkv(3, B=2, T=S, N=4, K=2, H=8)
    full = attn.dot_product_attention(q, k, v, mask=MASKS[mask])
    tail = attend(impl, **BLOCKS)(q[:, -T:], k, v, mask=MASKS[mask])
    assert rel_err(tail, full[:, -T:]) <= TOL


def test_blockwise_gradients_follow_the_same_default():
    q, k, v = qkv(4, B=2, T=S, N=4, K=2, H=8)
    mask = MASKS["streaming"]

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q[:, -7:], k, v, mask=mask)))

    want = jax.grad(loss(attn.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(attend("blockwise", **BLOCKS)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) <= 1e-4  # composed: forward, then the flash backward


@pytest.mark.parametrize("impl", CASES)
def test_more_queries_than_keys_need_positions(impl):
    q, k, v = qkv(5, B=1, T=9, S=4, N=2)
    fn = attend(impl, **BLOCKS)
    with pytest.raises(ValueError, match=r"q_positions.*T > S"):
        fn(q, k, v, mask=masks.causal())
    # With positions it is well defined, and a full mask needs none (cross-attention).
    pos = jnp.arange(9) - 5
    out = fn(q, k, v, mask=masks.causal(), q_positions=pos)
    want = attn.dot_product_attention(q, k, v, mask=masks.causal(), q_positions=pos)
    assert rel_err(out, want) <= TOL
    assert fn(q, k, v).shape == (1, 9, 2, 8)


def test_keys_at_explicit_positions_need_query_positions_too():
    q, k, v = qkv(6, B=1, T=2, S=6, N=2)
    with pytest.raises(ValueError, match=r"q_positions.*kv_positions"):
        attn.dot_product_attention(q, k, v, mask=masks.causal(), kv_positions=jnp.arange(6) + 10)


@pytest.mark.parametrize("mask", [masks.causal(), masks.sliding_window(3)])
def test_xla_keeps_our_alignment_where_jax_nn_aligns_top_left(mask):
    q, k, v = qkv(7, B=1, T=3, S=8, N=2)
    # The top-left alignment is really another function: query 0 would see key 0 only.
    top_left = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    ours = attn.attention(q, k, v, mask=mask)
    assert rel_err(top_left, attn.attention(q, k, v, mask=masks.causal())) > 0.1
    # impl="xla" gives jax.nn the visibility as a mask array, so it computes ours...
    assert rel_err(attn.attention(q, k, v, impl="xla", mask=mask), ours) <= 1e-6


@pytest.mark.parametrize("impl", CASES)
def test_is_causal_is_jax_nn_top_left_mask_in_every_impl(impl):
    """...while ``is_causal=True`` is jax.nn's own top-left mask, in every implementation."""
    q, k, v = qkv(7, B=1, T=3, S=8, N=2)
    top_left = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(attend(impl)(q, k, v, is_causal=True), top_left) <= 1e-6
