"""A bias and a boolean mask array (``jax.nn``'s) in every implementation that reads them.

Dense materializes them; blockwise and Pallas read one tile per block pair and
skip the blocks the mask hides entirely; jax.nn takes them as they are. The
implementations are ``attn.dispatch.CAPABILITIES``'s with ``bias`` and
``mask_array``; those without refuse them by name. Checked against a float64 oracle
written from the definition, ``softmax(scale * q.k + bias)`` over the visible
keys, outputs and gradients (the bias's included), for biases broadcast along
every axis and masks with hidden rows and hidden blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from attn.softmax.blockwise import count_blocks
from tests.attn.impls import SMALL_FLOAT32, attend, impls_with, impls_without, params
from tests.util import normal, qkv, rel_err

B, T, S, N, K, H = 2, 20, 28, 4, 2, 8
TILES = dict(block_q=8, block_k=8)
IMPLS = impls_with(*SMALL_FLOAT32, "bias", "mask_array")


def keep_array():
    """``[B,1,T,S]``: random, with query 3 seeing nothing and block (1, 1) hidden in both rows."""
    keep = np.random.default_rng(0).random((B, 1, T, S)) > 0.3
    keep[:, :, 3] = False
    keep[:, :, 8:16, 8:16] = False
    return jnp.asarray(keep)


def oracle(q, k, v, bias, keep):
    """Float64 attention from its definition; a row with nothing visible gives 0."""
    q, k, v, bias = (x.astype(jnp.float64) for x in (q, k, v, bias))
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * H**-0.5 + bias
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    p = jnp.where(keep, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    w = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-300)
    return jnp.einsum("bnts,bsne->btne", w, v)


@pytest.mark.parametrize("impl", IMPLS)
def test_bias_and_mask_arrays_match_the_float64_oracle(impl):
    q, k, v = qkv(1, B=B, T=T, S=S, N=N, K=K, H=H)
    keep = keep_array()
    dout = normal(5, (B, T, N, H))
    # (A bias constant along S would not change the softmax: its gradient is 0.)
    # (A rank-2 mask or bias broadcasts like these: tests/attn/test_jax_nn_compat.py.)
    for shape in [(1, N, T, S), (B, 1, 1, S)]:
        bias = normal(len(shape), shape)

        def ours(q, k, v, bias):
            out = attend(impl, **TILES)(q, k, v, bias, keep)
            return (out * dout).sum(), out

        (_, out), grads = jax.value_and_grad(ours, argnums=(0, 1, 2, 3), has_aux=True)(
            q, k, v, bias
        )
        with jax.enable_x64(True):
            x64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, bias, dout)]

            def theirs(q, k, v, bias, dout):
                full = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
                return (oracle(q, k, v, full, keep) * dout).sum()

            want = jax.grad(theirs, argnums=(0, 1, 2, 3))(*x64)
            want_out = oracle(*x64[:3], x64[3].reshape((1,) * (4 - len(shape)) + shape), keep)
        assert not np.asarray(out[:, 3]).any()  # the row that sees nothing: zeros
        assert rel_err(out, want_out) <= 2e-6
        for name, a, b in zip(["q", "k", "v", "bias"], grads, want, strict=True):
            assert rel_err(a, b) <= 2e-6, (shape, name, rel_err(a, b))


def test_a_hidden_block_is_skipped_and_a_traced_mask_too():
    """Causal as a mask array: the blocks above the diagonal are never visited, and only
    the diagonal ones evaluate the mask, as for ``masks.causal()``; under ``jit`` (the
    mask traced) the schedule is built at run time with the same counts."""
    q, k, v = qkv(2, B=1, T=64, S=64, N=2, H=8)
    tril = jnp.tril(jnp.ones((64, 64), bool))
    want = count_blocks(q, k, v, mask=masks.causal(), block_q=16, block_k=16)
    assert want == (6, 4, 16)
    assert count_blocks(q, k, v, mask=tril, block_q=16, block_k=16) == want
    traced = jax.jit(lambda m: count_blocks(q, k, v, mask=m, block_q=16, block_k=16))(tril)
    assert tuple(int(x) for x in traced[:2]) == want[:2]
    for impl in impls_with(*SMALL_FLOAT32, "mask_array"):
        got = jax.jit(lambda m, impl=impl: attend(impl, **TILES)(q, k, v, mask=m))
        assert rel_err(got(tril), attn.attention(q, k, v, mask=masks.causal())) <= 1e-6, impl


# The interpreted kernels' cases in the integration tier (the fast tier's time).
@pytest.mark.parametrize(
    "impl", params(impls_with(*SMALL_FLOAT32), interpreted_in_integration=True)
)
def test_is_causal_and_windows_are_top_left_like_jax_nn(impl):
    q, k, v = qkv(3, B=2, T=6, S=10, N=2)
    for kw in [dict(is_causal=True), dict(local_window_size=(2, 1)), dict(local_window_size=3)]:
        want = jax.nn.dot_product_attention(q, k, v, **kw)
        assert rel_err(attend(impl, **TILES)(q, k, v, **kw), want) <= 1e-6, (impl, kw)


def test_empty_rows_mean_is_jax_nn_and_zero_is_ours():
    q, k, v = qkv(4, B=2, T=8, N=2)
    keep = jnp.ones((2, 1, 8, 8), bool).at[1, :, 5].set(False)
    lengths = jnp.array([8, 6], jnp.int32)
    kw = dict(query_seq_lengths=lengths)
    want = jax.nn.dot_product_attention(q, k, v, mask=keep, **kw)
    for impl in impls_with(*SMALL_FLOAT32, "mask_array", "empty_rows_mean"):
        mean = attend(impl, **TILES)(q, k, v, mask=keep, empty_rows="mean", **kw)
        zero = attend(impl, **TILES)(q, k, v, mask=keep, **kw)
        assert rel_err(mean, want) <= 1e-6, impl
        assert not np.asarray(zero[1, 5]).any() and rel_err(zero[1, :5], want[1, :5]) <= 1e-6
        assert not np.asarray(mean[1, 6:]).any()  # padding queries: 0 in both, as in jax.nn


def test_rank3_inputs_residual_and_implementation_as_jax_nn_takes_them():
    q, k, v = qkv(5, B=1, T=6, N=2)
    out, lse = attn.attention(q[0], k[0], v[0], is_causal=True, return_residual=True)
    want, want_lse = jax.nn.dot_product_attention(
        q[0], k[0], v[0], is_causal=True, return_residual=True
    )
    assert out.shape == want.shape and lse.shape == want_lse.shape == (6, 2)
    assert rel_err(out, want) <= 1e-6 and rel_err(lse, want_lse) <= 1e-6
    xla = attn.attention(q, k, v, implementation="xla", return_residual=True)
    assert rel_err(xla[1], attn.attention(q, k, v, return_lse=True)[1]) <= 1e-6
    with pytest.raises(ValueError, match="implementation"):
        attn.attention(q, k, v, impl="dense", implementation="xla")
    with pytest.raises(ValueError, match="implementation"):
        attn.dot_product_attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match="return_residual"):
        attn.attention(q, k, v, return_residual=True, return_lse=True)


def test_what_cannot_read_an_array_says_so():
    q, k, v = qkv(6, B=1, T=4, N=2)
    bias = jnp.zeros((1, 2, 4, 4))
    with pytest.raises(ValueError, match="bias: expected no bias array for decode_attention"):
        attn.decode_attention(q[:, :1], k, v, lengths=jnp.array([4]), bias=bias[:, :, :1])
    with pytest.raises(ValueError, match="query_seq_lengths: expected None"):
        attn.decode_attention(q[:, :1], k, v, lengths=jnp.array([4]),
                              query_seq_lengths=jnp.array([1]))  # fmt: skip
    for impl in impls_without("mask_array"):
        with pytest.raises(ValueError, match=f"mask: expected no mask array for impl={impl!r}"):
            attend(impl)(q, k, v, mask=jnp.ones((4, 4), bool))
