"""attn.sparse.exact's fixed-order sums: the sum they are, the same bits in any batch or
shape around them, their gradients; and the cache's block sums built on them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.sparse import block_key_sums, window_key_sums
from attn.sparse.exact import halves, tree_dot, tree_sum


def test_tree_sum_is_the_sum_in_one_order_whatever_surrounds_it():
    x = np.random.default_rng(0).standard_normal((6, 5, 13)).astype(np.float32)
    got = tree_sum(jnp.asarray(x))
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-6, atol=1e-6)
    # One row alone, or moved to another axis, gives the same bits as within the batch.
    np.testing.assert_array_equal(tree_sum(jnp.asarray(x[2:3, 1:2])), got[2:3, 1:2])
    np.testing.assert_array_equal(tree_sum(jnp.moveaxis(jnp.asarray(x), -1, 0), axis=0), got)
    assert halves(13) == [8, 4, 2, 1] and halves(1) == [] and halves(16) == [8, 4, 2, 1]
    np.testing.assert_array_equal(tree_sum(jnp.ones((2, 0))), np.zeros(2))
    a, b = (jnp.asarray(x[..., :8]), jnp.asarray(x[..., 5:]))
    np.testing.assert_allclose(tree_dot(a, b), (x[..., :8] * x[..., 5:]).sum(-1), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    # Linear and bilinear: the gradients are ones and the other operand.
    np.testing.assert_array_equal(jax.grad(lambda x: tree_sum(x).sum())(jnp.asarray(x)), 1.0)
    ga, gb = jax.grad(lambda a, b: tree_dot(a, b).sum(), (0, 1))(a, b)
    np.testing.assert_array_equal(ga, b)
    np.testing.assert_array_equal(gb, a)


def test_window_sums_are_the_block_sums_at_each_block_s_last_key_and_differentiate():
    """The cache's sums (each new key's block so far, zeros after it) against the forward
    pass's (``block_key_sums``): bitwise at every block's last key, blocks of 4 over 10
    keys (the last block short), and gradients where the key counts."""
    k = jnp.asarray(np.random.default_rng(1).standard_normal((2, 10, 3, 5)), jnp.float32)
    slot = jnp.arange(4)
    offset = jnp.arange(10) % 4
    index = jnp.arange(10)[:, None] - offset[:, None] + slot  # [T, 4] key of each slot
    windows = jnp.where((slot <= offset[:, None])[None, :, :, None, None],
                        k[:, jnp.clip(index, 0, 9)], 0.0)  # fmt: skip
    ends = np.array([3, 7, 9])
    np.testing.assert_array_equal(window_key_sums(windows)[:, ends],
                                  block_key_sums(k, 4)[:, ends])  # fmt: skip
    grad = jax.grad(lambda w: window_key_sums(w)[:, 9].sum())(windows)
    np.testing.assert_array_equal(grad[:, 9], 1.0)  # slots past the key are zeros, still summed
    np.testing.assert_array_equal(grad[:, :9], 0.0)
    with pytest.raises(ValueError, match=r"^windows: expected \[B,T,block_size,K,H\]"):
        window_key_sums(windows[0])
