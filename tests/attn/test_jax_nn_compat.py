"""JAX's own tests of ``jax.nn.dot_product_attention``, run on ``attn.attention`` for every impl.

Rewritten from jax's ``tests/nn_test.py`` (``testDotProductAttention``,
``testDotProductAttentionMask``, ``testDotProductAttentionBiasGradient``): the same
arguments, the same reference (``jax.nn`` with ``implementation=None``, GQA
given repeated K/V) and the same checks and tolerances on the outputs and on
every gradient, bias included, with their ``implementation="cudnn"`` replaced by
each implementation of ours. Changed, to fit the suite's time: T = S = 32 (theirs
128) and a batch of 4 where theirs is 16, with 16-row tiles so the fused
kernels cross several, and the product of dtypes, group sizes and vmap
thinned to three cases that cover each value. The implementations are those
of ``attn.dispatch.CAPABILITIES`` that take the inputs (head dim 32: not
Mosaic's; cuDNN only on a GPU); one that lacks what a case needs (splash: a
bias or a mask array) must refuse it by name, and the test checks that refusal
instead.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import random

import attn
from tests.attn.impls import SMALL_FLOAT32, attend, impls_with, refuses

TILES = dict(block_q=16, block_k=16)
IMPLS = impls_with("head_dim_8k")  # bfloat16 and float16 inputs, head dim 32


def ours(impl):
    return attend(impl, **TILES)


def close(a, b, tol):
    """jax's ``assertAllClose(a, b, atol=tol, rtol=tol)``, compared in float32."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    assert jnp.allclose(a, b, atol=tol, rtol=tol), float(jnp.abs(a - b).max())


def test_signature_is_a_superset_of_jax_nn():
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    for fn in (attn.attention, attn.dot_product_attention):
        mine = inspect.signature(fn).parameters
        assert set(theirs) <= set(mine), set(theirs) - set(mine)
        positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert list(mine)[: len(positional)] == positional


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("dtype", "group_num", "use_vmap"),
    [
        (jnp.bfloat16, 1, False),
        pytest.param(jnp.float16, 2, True, marks=pytest.mark.integration),  # float16: slow tier
        (jnp.bfloat16, 4, True),
    ],
    ids=["bf16-1", "f16-2-vmap", "bf16-4-vmap"],
)
def test_dot_product_attention(impl, dtype, group_num, use_vmap):
    B, S, T, N, H, G = 2, 32, 32, 4, 32, group_num
    keys = random.split(random.PRNGKey(0), 5)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N // G, H), dtype)
    V = random.normal(keys[2], (B, S, N // G, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    bias, mask = None, None

    sdpa_ref = functools.partial(jax.nn.dot_product_attention, implementation=None)
    sdpa_ans = ours(impl)
    if use_vmap:  # rank-3 inputs per example
        sdpa_ans = jax.vmap(sdpa_ans, in_axes=(0, 0, 0, None, None), out_axes=0)

    K_ref, V_ref = jnp.repeat(K, G, axis=2), jnp.repeat(V, G, axis=2)
    out_ref, sdpa_vjp_ref = jax.vjp(sdpa_ref, Q, K_ref, V_ref, bias, mask)
    out_ans, sdpa_vjp_ans = jax.vjp(sdpa_ans, Q, K, V, bias, mask)
    dQ_ref, dK_ref, dV_ref = sdpa_vjp_ref(grad)[:3]
    dQ_ans, dK_ans, dV_ans = sdpa_vjp_ans(grad)[:3]
    dK_ref = dK_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref = dV_ref.reshape(B, S, N // G, G, H).sum(axis=3)

    close(out_ref, out_ans, 0.01)
    close(dQ_ref, dQ_ans, 0.01)
    close(dK_ref, dK_ans, 0.01)
    close(dV_ref, dV_ans, 0.01)


# Each mode alone in the fast tier; their compositions (jax's own cases) in the integration tier.
_COMBINED = pytest.mark.integration
MASK_MODES = [
    ("bias",),
    ("causal",),
    ("padding",),
    ("custom",),
    pytest.param(("causal", "padding"), marks=_COMBINED, id="causal+padding"),
    pytest.param(("custom", "padding"), marks=_COMBINED, id="custom+padding"),
    pytest.param(("bias", "causal"), marks=_COMBINED, id="bias+causal"),
    ("causal", "sliding_window"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mask_mode", MASK_MODES, ids="+".join)
def test_dot_product_attention_mask(impl, mask_mode):
    dtype = jnp.bfloat16
    B, S, T, N, H = 2, 32, 32, 4, 32
    keys = random.split(random.PRNGKey(0), 5)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N, H), dtype)
    V = random.normal(keys[2], (B, S, N, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    bias, mask = None, None
    q_seqlen, kv_seqlen = None, None
    window_size = None

    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        custom_mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))
        mask = custom_mask[None, None, :, :]
    if "bias" in mask_mode:
        bias = random.normal(keys[4], (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
        window_size = (3, 2) if is_causal else (3, 0)

    kwargs = dict(
        is_causal=is_causal,
        query_seq_lengths=q_seqlen,
        key_value_seq_lengths=kv_seqlen,
        local_window_size=window_size,
    )
    needs = {"bias"} if bias is not None else set()
    needs |= {"mask_array"} if mask is not None else set()
    if refuses(impl, needs, ours(impl), Q, K, V, bias, mask, **kwargs):
        return

    def fn(sdpa, q, k, v, b, m):
        return sdpa(q, k, v, b, m, **kwargs)

    fn_ref = functools.partial(fn, functools.partial(jax.nn.dot_product_attention))
    fn_ans = functools.partial(fn, ours(impl))
    args = (Q, K, V, bias, mask)
    out_ref, sdpa_vjp_ref = jax.vjp(fn_ref, *args)
    out_ans, sdpa_vjp_ans = jax.vjp(fn_ans, *args)
    dQ_ref, dK_ref, dV_ref, dbias_ref = sdpa_vjp_ref(grad)[:4]
    dQ_ans, dK_ans, dV_ans, dbias_ans = sdpa_vjp_ans(grad)[:4]

    close(out_ref, out_ans, 0.01)
    close(dQ_ref, dQ_ans, 0.02)
    close(dK_ref, dK_ans, 0.02)
    close(dV_ref, dV_ans, 0.01)
    if bias is not None:
        close(dbias_ref, dbias_ans, 0.02)


@pytest.mark.parametrize("impl", impls_with(*SMALL_FLOAT32))
def test_a_row_with_no_keys_is_the_mean_of_v_under_empty_rows_mean(impl):
    """Row 0 has ``key_value_seq_lengths`` 0: jax.nn gives every query the mean of all of V
    (its padding's included), and so does every impl under ``empty_rows="mean"``."""
    q, k, v = (random.normal(random.PRNGKey(i), (2, 16, 2, 16)) for i in range(3))
    lengths = jnp.array([0, 5], jnp.int32)
    kw = dict(key_value_seq_lengths=lengths, empty_rows="mean")
    if refuses(impl, {"empty_rows_mean"}, ours(impl), q, k, v, **kw):  # splash: no lse
        return
    want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)
    got = ours(impl)(q, k, v, key_value_seq_lengths=lengths, empty_rows="mean")
    close(got, want, 1e-6)
    close(got[0], jnp.broadcast_to(v[0].mean(0), got[0].shape), 1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("batch_size", "use_vmap"), [(1, False), (4, True)])
def test_dot_product_attention_bias_gradient(impl, batch_size, use_vmap):
    """jax's test expects cuDNN to refuse a bias gradient for a batch of more than 1;
    every implementation of ours computes it, and it is checked against jax.nn's."""
    dtype = jnp.bfloat16
    B, S, N, H = batch_size, 32, 4, 32
    keys = random.split(random.PRNGKey(0), 2)
    x = random.normal(keys[0], (B, S, N, H), dtype)
    bias = random.normal(keys[1], (B, N, S, S), dtype=dtype)
    mask = jnp.ones((1, 1, S), dtype=jnp.bool_)
    if refuses(impl, {"bias", "mask_array"}, ours(impl), x, x, x, bias, mask):
        return

    def attention(x, bias, mask, sdpa):
        return sdpa(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

    attn_ref = functools.partial(attention, sdpa=jax.nn.dot_product_attention)
    attn_ans = functools.partial(attention, sdpa=ours(impl))
    if use_vmap:
        attn_batched_ref = jax.vmap(attn_ref, in_axes=(0, 0, None))
        attn_batched_ans = jax.vmap(attn_ans, in_axes=(0, 0, None))
    else:
        attn_batched_ref, attn_batched_ans = attn_ref, attn_ans
    close(jax.jit(attn_batched_ref)(x, bias, mask), jax.jit(attn_batched_ans)(x, bias, mask), 0.01)

    @functools.partial(jax.jit, static_argnums=3)
    def bwd(x, bias, mask, fn):
        _, f_vjp = jax.vjp(fn, x, bias, mask)
        return f_vjp(x)

    _, dbias_ref, _ = bwd(x, bias, mask, attn_ref)
    _, dbias_ans, _ = bwd(x, bias, mask, attn_ans)
    close(dbias_ans, dbias_ref, 0.1)


@pytest.mark.parametrize("impl", impls_with(*SMALL_FLOAT32, "mask_array", "empty_rows_mean"))
def test_flax_multi_head_attention_with_ours_equals_its_default(impl):
    """``nnx.MultiHeadAttention(attention_fn=attn.flax_attention_fn(impl))`` is the layer
    with Flax's own attention, outputs and parameter gradients (a padding mask with a
    row that sees nothing included: both give it the mean of V)."""
    B, T, D, N = 2, 12, 32, 4
    x = random.normal(random.PRNGKey(1), (B, T, D))
    keep = jnp.arange(T)[None, :] < jnp.array([[9], [12]])  # [B, T]
    # Flax's masks are float32 by default: nonzero is visible.
    mask = nnx.make_attention_mask(keep, keep) * nnx.make_causal_mask(keep[:1])
    mask = mask.at[0, :, 2].set(0.0)  # a query of row 0 sees nothing

    def layer(attention_fn):
        kwargs = {} if attention_fn is None else dict(attention_fn=attention_fn)
        return nnx.MultiHeadAttention(N, D, D, decode=False, rngs=nnx.Rngs(0), **kwargs)

    def loss(model):
        return (model(x, mask=mask) ** 2).sum()

    theirs, mine = layer(None), layer(attn.flax_attention_fn(**ours(impl).keywords))
    close(mine(x, mask=mask), theirs(x, mask=mask), 2e-5)
    g_theirs, g_mine = nnx.grad(loss)(theirs), nnx.grad(loss)(mine)
    for a, b in zip(jax.tree.leaves(g_mine), jax.tree.leaves(g_theirs), strict=True):
        close(a, b, 2e-4)


def test_flax_attention_fn_refuses_what_it_cannot_compute():
    q = random.normal(random.PRNGKey(2), (2, 3, 5, 2, 8))  # two batch axes
    fn = attn.flax_attention_fn("dense")
    assert fn(q, q, q).shape == q.shape
    close(fn(q, q, q), nnx.dot_product_attention(q, q, q), 1e-6)
    with pytest.raises(ValueError, match=r"^dropout_rate: expected 0.0 or deterministic=True"):
        fn(q, q, q, dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match=r"^module: expected None"):
        fn(q, q, q, module=object())
