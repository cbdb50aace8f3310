"""The isolation rule in every family: what a function documents as unread reaches nothing.

Padding (segment id 0), compressed slots without a block, and the indexer's
inputs at padding hold whatever memory held. Each case runs a family's
function twice on one packed batch, once with random values in those slots and
once with NaN, +Inf and -Inf there, and asserts that the outputs and the
gradients of every input are the same bits (zeros where unread). One compiled
program serves both runs (the same shapes).

The coverage, family x poisoned slot (the softmax implementations, linear
attention, the delta rule and the short convolution are also compared with
each segment run alone in ``test_packing.py``; the sharded forms in
``tests/devices/test_sharded_linear.py``; cache slots and pages in
``test_decode.py``, ``test_paged.py`` and ``tests/models``):

============================  ==================================================
MoBA                          padding of q, k, v
NSA                           padding of q, k, v, gates; compressed k, v slots
                              without a block
DSA attention                 padding of q, k, v, index_q, index_k, index_w
DSA indexer loss              padding of q, k, index_q, index_k, index_w
SSD (Mamba-2), every form     padding of x, dt, B, C
DeltaProduct, every form      padding of q, k, v, beta, log_gates
delta rule, linear attention  padding of every per-token input
RWKV-7's DPLR rule, log-      padding of every per-token input
linear attention and Gated
DeltaNet, PaTH-FoX
function kinds                padding of q, k, v (sigmoid, softpick)
============================  ==================================================
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
import models
from attn import masks, sparse
from models.functions import FunctionAttention
from tests.util import normal

IDS = np.array(
    [
        [1] * 6 + [0] * 2 + [2] * 5 + [0] * 3,
        [0] * 3 + [3] * 9 + [0] * 4,
    ],
    np.int32,
)
B, T = IDS.shape
N, K, H = 4, 2, 8
PAD = IDS == 0


def _positions():
    """``[B,T]`` positions restarting at each segment."""
    pos = np.zeros_like(IDS)
    for b in range(B):
        start = np.flatnonzero(np.r_[True, IDS[b, 1:] != IDS[b, :-1]])
        for s, e in zip(start, np.r_[start[1:], T], strict=True):
            pos[b, s:e] = np.arange(e - s)
    return jnp.asarray(pos)


ROWS = dict(
    q_positions=_positions(),
    kv_positions=_positions(),
    q_segment_ids=jnp.asarray(IDS),
    kv_segment_ids=jnp.asarray(IDS),
)
CAUSAL = dict(ROWS, mask=masks.causal())


def _junk(shape):
    """NaN, +Inf and -Inf in turn along the last axes."""
    return np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), shape)


def _fill(x, unread, values):
    unread = unread.reshape(unread.shape + (1,) * (x.ndim - unread.ndim))
    return jnp.where(jnp.asarray(unread), jnp.asarray(values, x.dtype), x)


def assert_isolated(fn, inputs, unread, seed=0):
    """``fn(*inputs)`` with random values, then junk, at ``unread[i]`` (a bool mask over the
    leading axes of ``inputs[i]``, or None): output and gradients the same bits."""

    def loss(args, cot):
        out = fn(*args)
        return jnp.sum(out * cot), out

    run = jax.jit(jax.grad(loss, has_aux=True))
    out = jax.eval_shape(fn, *inputs)
    cot = normal((seed, 99), out.shape)
    rng = np.random.default_rng(seed)
    runs = []
    for fill in ("random", "junk"):
        args = tuple(
            x
            if where is None
            else _fill(x, where, _junk(x.shape) if fill == "junk" else rng.normal(size=x.shape))
            for x, where in zip(inputs, unread, strict=True)
        )
        runs.append(run(args, cot))
    (clean_grads, clean), (grads, got) = runs
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(got, clean)
    for i, (g, want) in enumerate(zip(grads, clean_grads, strict=True)):
        np.testing.assert_array_equal(g, want, err_msg=f"input {i}")


def _qkv(seed, E=H):
    return (
        normal((seed, 0), (B, T, N, H)),
        normal((seed, 1), (B, T, K, H)),
        normal((seed, 2), (B, T, K, E)),
    )


def test_moba():
    fn = functools.partial(attn.moba_attention, block_size=4, top_k=2, chunk=8, **CAUSAL)
    assert_isolated(fn, _qkv(1), (PAD, PAD, PAD))


def test_nsa():
    sizes = dict(compress_block=4, compress_stride=2, select_block=4, num_selected=2, window=3)
    win = dict(kv_positions=ROWS["kv_positions"], kv_segment_ids=ROWS["kv_segment_ids"])
    _, real = sparse.compression_windows(jnp.zeros((B, T, K, H)), compress_block=4,
                                         compress_stride=2, **win)  # fmt: skip
    M = real.shape[1]
    q, k, v = _qkv(2)
    gates = jax.nn.sigmoid(normal(3, (B, T, N, 3)))
    ck, cv = normal(4, (B, M, K, H)), normal(5, (B, M, K, H))
    assert (~np.asarray(real)).any()
    fn = functools.partial(sparse.nsa_attention, chunk=8, **sizes, **CAUSAL)
    assert_isolated(fn, (q, k, v, gates, ck, cv), (PAD, PAD, PAD, PAD, ~real, ~real))


DSA_INDEX = 3, 5  # indexer heads I and dim F


def _index(seed):
    I, F = DSA_INDEX
    return (
        normal((seed, 0), (B, T, I, F)),
        normal((seed, 1), (B, T, F)),
        normal((seed, 2), (B, T, I)),
    )


def test_dsa_attention():
    fn = functools.partial(attn.indexed_topk_attention, top_k=3, chunk=8, **CAUSAL)
    assert_isolated(fn, (*_qkv(6), *_index(7)), (PAD,) * 6)


@pytest.mark.parametrize("top_k", [None, 3], ids=["dense", "sparse"])
def test_dsa_indexer_loss(top_k):
    q, k, _ = _qkv(8)
    fn = functools.partial(sparse.indexer_loss, top_k=top_k, chunk=8, **CAUSAL)
    assert_isolated(fn, (q, k, *_index(9)), (PAD,) * 5)


@pytest.mark.parametrize("form", attn.SSD_FORMS)
def test_ssd(form):
    x = normal(10, (B, T, N, H))
    dt = jax.nn.softplus(normal(11, (B, T, N)))
    A = -jnp.exp(normal(12, (N,)))
    Bm, Cm = normal(13, (B, T, K, H)), normal(14, (B, T, K, H))

    def fn(x, dt, Bm, Cm):
        return attn.ssd(
            x, dt, A, Bm, Cm, form=form, chunk_size=4, segment_ids=ROWS["kv_segment_ids"]
        )

    assert_isolated(fn, (x, dt, Bm, Cm), (PAD,) * 4)


@pytest.mark.parametrize("form", attn.DELTA_FORMS)
def test_delta_product(form):
    n = 2
    q, k = normal(15, (B, T, K, H)), normal(16, (B, T, n, K, H))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v, beta = normal(17, (B, T, n, N, H)), jax.nn.sigmoid(normal(18, (B, T, n, N)))
    log_gates = -jnp.abs(normal(19, (B, T, N)))
    seg = dict(q_segment_ids=ROWS["q_segment_ids"], kv_segment_ids=ROWS["kv_segment_ids"])

    def fn(q, k, v, beta, log_gates):
        return attn.delta_product(
            q, k, v, beta, log_gates=log_gates, form=form, chunk_size=4, **seg
        )

    assert_isolated(fn, (q, k, v, beta, log_gates), (PAD,) * 5)


def test_delta_rule_and_linear_attention():
    q, k = normal(20, (B, T, K, H)), normal(21, (B, T, K, H))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v, beta = normal(22, (B, T, N, H)), jax.nn.sigmoid(normal(23, (B, T, N)))
    log_gates = -jnp.abs(normal(24, (B, T, N)))
    seg = dict(q_segment_ids=ROWS["q_segment_ids"], kv_segment_ids=ROWS["kv_segment_ids"])

    def fn(q, k, v, beta, log_gates):
        delta = attn.delta_rule(q, k, v, beta, log_gates=log_gates, chunk_size=4, **seg)
        qn, kn = (jnp.repeat(x, N // K, axis=2) for x in (q, k))
        linear = attn.linear_attention(qn, kn, v, log_gates=log_gates, chunk_size=4, **seg)
        return delta + linear

    assert_isolated(fn, (q, k, v, beta, log_gates), (PAD,) * 5)


@pytest.mark.integration  # the fast tier's 4 minutes are full
def test_newest_families():
    """RWKV-7's DPLR rule, log-linear attention and Gated DeltaNet, and PaTH-FoX, each in its
    fast form, summed: one program."""
    unit = functools.partial(jax.nn.standardize, axis=-1)  # then scaled to norm 1 below
    q, k = normal(40, (B, T, K, H)), unit(normal(41, (B, T, K, H))) / np.sqrt(H)
    v = normal(42, (B, T, N, H))
    kappa = unit(normal(43, (B, T, K, H))) / np.sqrt(H)
    a, b = -kappa, kappa * jax.nn.sigmoid(normal(44, (B, T, K, H)))
    log_w = -np.exp(-0.5) * jax.nn.sigmoid(normal(45, (B, T, N, H)))
    beta, log_a = jax.nn.sigmoid(normal(46, (B, T, N))), -jnp.abs(normal(47, (B, T, N)))
    levels = jax.nn.softplus(normal(48, (B, T, N, 5)))
    q_n, v_k = normal(49, (B, T, N, H)), normal(50, (B, T, K, H))
    w, w_beta = (
        unit(normal(51, (B, T, K, H))) / np.sqrt(H),
        2 * jax.nn.sigmoid(normal(52, (B, T, K))),
    )
    log_f = -jnp.abs(normal(53, (B, T, N)))
    seg = dict(q_segment_ids=ROWS["q_segment_ids"], kv_segment_ids=ROWS["kv_segment_ids"])

    def fn(q, k, v, a, b, log_w, beta, log_a, levels, q_n, v_k, w, w_beta, log_f):
        dplr = attn.dplr_delta_rule(q, k, v, a, b, log_w, chunk_size=4, **seg)
        log_linear = attn.log_linear_attention(q, k, v, log_a, levels, chunk_size=4, **seg)
        log_delta = attn.log_linear_delta_rule(
            q, k, v, beta, levels, log_gates=log_a, chunk_size=4, **seg
        )
        path = attn.path_attention(q_n, k, v_k, w, w_beta, log_forget=log_f, block_size=4, **seg)
        return dplr + log_linear + log_delta + path

    inputs = (q, k, v, a, b, log_w, beta, log_a, levels, q_n, v_k, w, w_beta, log_f)
    assert_isolated(fn, inputs, (PAD,) * len(inputs))


def test_value_checks_read_real_tokens_only():
    """Eagerly, where values are checked: junk in the padding of dt, beta and log gates is
    not refused (padding holds anything), the same junk at a real token is, in one line."""
    seg = ROWS["kv_segment_ids"]
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg)
    x, Bm = normal(30, (B, T, N, H)), normal(31, (B, T, K, H))
    dt, A = _fill(jax.nn.softplus(normal(32, (B, T, N))), PAD, _junk((B, T, N))), -jnp.ones(N)
    q, k = normal(33, (B, T, K, H)), normal(34, (B, T, K, H))
    beta = _fill(jax.nn.sigmoid(normal(35, (B, T, N))), PAD, _junk((B, T, N)))
    gates = _fill(-jnp.abs(normal(36, (B, T, N))), PAD, _junk((B, T, N)))
    assert np.isfinite(attn.ssd(x, dt, A, Bm, Bm, segment_ids=seg, form="recurrent")).all()
    assert np.isfinite(
        attn.delta_rule(q, k, x, beta, log_gates=gates, form="recurrent", **ids)
    ).all()
    assert np.isfinite(
        attn.linear_attention(x, x, x, log_gates=gates, form="recurrent", **ids)
    ).all()
    real = (0, 0, 1)  # a real token's entry
    with pytest.raises(ValueError, match=r"^dt: expected finite values >= 0 .*got 1 non-finite"):
        attn.ssd(x, dt.at[real].set(jnp.inf), A, Bm, Bm, segment_ids=seg)
    with pytest.raises(ValueError, match=r"^beta: expected finite values .*got 1 non-finite"):
        attn.delta_rule(q, k, x, beta.at[real].set(jnp.nan), **ids)
    with pytest.raises(ValueError, match=r"^log_gates: expected values <= 0"):
        attn.linear_attention(x, x, x, log_gates=gates.at[real].set(jnp.nan), **ids)


FUNCTION_KINDS = sorted(
    name for name, kind in models.KINDS.items() if issubclass(kind.module, FunctionAttention)
)


@pytest.mark.parametrize("name", FUNCTION_KINDS)
def test_function_kinds(name):
    """Every registered function kind, called as its layer calls it (``kv_length`` included)."""
    kv_length = ROWS["q_positions"] + 1
    fn = functools.partial(models.KINDS[name].module.fn, kv_length=kv_length, **CAUSAL)
    assert_isolated(fn, _qkv(25), (PAD,) * 3)
