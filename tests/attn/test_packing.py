"""One segment-id convention in every implementation: one packed, padded batch, per-sequence runs.

Id 0 is padding (it sees no key, no query sees it, it outputs 0 and gets zero
gradients), ids >= 1 are segments, negative ids are refused. Padding holds
whatever memory held: here NaN, +Inf and -Inf, which must reach no real token,
forward or backward. The same batch
(segments of 5 tokens, padding before, between and after them, ids that are
not in order) goes through every softmax implementation that takes its inputs
(``attn.dispatch.CAPABILITIES``: the kernels in interpret mode), linear
attention (its three forms) and the short convolution; each must equal the
implementation run on every segment alone, forward and gradients. (Ring
attention compares the same kind of batch with dense attention over 4 and 8
devices: tests/attn/ring.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks
from attn.dispatch import CAPABILITIES
from tests.attn.impls import SMALL_FLOAT32, attend, impls_with
from tests.util import normal, rel_err

RTOL = 1e-5
N, K, H = 4, 2, 8
L = 5  # every segment's length, so the segments alone are one batch (one compile)
IDS = np.array(
    [
        [1] * L + [0] * 2 + [2] * L + [0] * 4,
        [0] * 3 + [7] * L + [0] + [3] * L + [0] * 2,
    ],
    np.int32,
)
B, T = IDS.shape
# (row, first index) of each segment of IDS.
SEGMENTS = [(0, 0), (0, 7), (1, 3), (1, 9)]
STREAMING = masks.causal() & (masks.sliding_window(3) | masks.initial_tokens(1))

SOFTMAX = impls_with(*SMALL_FLOAT32, auto=True)
TILES = dict(block_q=4, block_k=4)


def _alone(x):
    """``[B,T,...]`` -> the segments alone, ``[len(SEGMENTS), L, ...]``."""
    return jnp.stack([x[b, t : t + L] for b, t in SEGMENTS])


def _packed(alone, fill=0.0):
    """Inverse of ``_alone``: the segments back in their rows, ``fill`` at padding."""
    out = jnp.full((B, T, *alone.shape[2:]), fill, alone.dtype)
    for (b, t), x in zip(SEGMENTS, alone, strict=True):
        out = out.at[b, t : t + L].set(x)
    return out


def _poisoned(x):
    """``x [B,T,...]`` with NaN, +Inf and -Inf at padding tokens (what a stale slot may hold)."""
    junk = np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), T)[None, :]
    pad = (IDS == 0).reshape(IDS.shape + (1,) * (x.ndim - 2))
    junk = junk.reshape(junk.shape + (1,) * (x.ndim - 2))
    return jnp.where(pad, jnp.asarray(junk, x.dtype), x)


def _out_and_grads(fn, q, k, v, cot):
    """``fn``'s output and the gradients of ``sum(out * cot)``, as one compiled program."""

    def loss(q, k, v):
        out = fn(q, k, v)
        return (out * cot).sum(), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("impl", SOFTMAX)
def test_softmax_packed_equals_each_segment_alone(impl):
    q = normal(0, (B, T, N, H))
    k, v = normal(1, (B, T, K, H)), normal(2, (B, T, K, H))
    cot = normal(3, (B, T, N, H))
    ids = jnp.asarray(IDS)
    # Without "positions" (splash: one set for the whole batch), the causal mask on the
    # default positions: within a segment, each sequence's own causal mask.
    along_the_row = "positions" not in CAPABILITIES[impl]
    mask = masks.causal() if along_the_row else STREAMING
    kw = dict(mask=mask, q_segment_ids=ids, kv_segment_ids=ids)
    if not along_the_row:
        # Positions restart per segment: position-based masks see each sequence as if alone.
        kw |= dict(q_positions=restarted_positions(), kv_positions=restarted_positions())
    fn = attend(impl, **TILES)
    packed = functools.partial(fn, **kw)
    alone = functools.partial(fn, mask=mask)
    out, grads = _out_and_grads(packed, *map(_poisoned, (q, k, v)), cot)
    want, want_grads = _out_and_grads(alone, _alone(q), _alone(k), _alone(v), _alone(cot))
    assert rel_err(out, _packed(want)) <= RTOL  # padding rows: 0, as in want
    for g, w in zip(grads, want_grads, strict=True):
        assert rel_err(g, _packed(w)) <= RTOL  # zero at padding queries and keys
    padding = IDS == 0
    assert not np.asarray(out)[padding].any() and not np.asarray(grads[1])[padding].any()


def restarted_positions():
    """``[B,T]`` positions restarting at each segment (padding's are never looked at)."""
    starts = np.zeros_like(IDS)
    for b, t in SEGMENTS:
        starts[b, t : t + L] = t
    return jnp.asarray(np.arange(T) - starts, jnp.int32)


def _packed_and_alone(fn, inputs, cot, **ids_as):
    """``fn`` on the packed batch (padding poisoned) against ``fn`` on each segment alone.

    ``fn(*inputs, **ids)`` maps ``[B,T,...]`` inputs to ``[B,T,...]`` outputs;
    ``ids_as`` names its segment-id keywords. Compares the output and the
    gradients of ``sum(out * cot)`` for every input (zero at padding).
    """

    def loss(fn, inputs, cot):
        out = fn(*inputs)
        return (out * cot).sum(), out

    run = jax.jit(jax.grad(loss, argnums=1, has_aux=True), static_argnums=0)
    ids = {name: jnp.asarray(IDS) for name in ids_as}
    grads, out = run(functools.partial(fn, **ids), tuple(map(_poisoned, inputs)), cot)
    want_grads, want = run(fn, tuple(map(_alone, inputs)), _alone(cot))
    assert rel_err(out, _packed(want)) <= RTOL
    for g, w in zip(grads, want_grads, strict=True):
        assert rel_err(g, _packed(w)) <= RTOL  # zero at padding


SEGMENT_IDS = dict(q_segment_ids=None, kv_segment_ids=None)


@pytest.mark.parametrize("form", attn.LINEAR_FORMS)
def test_linear_packed_equals_each_segment_alone(form):
    def fn(q, k, v, log_gates, **ids):
        return attn.linear_attention(q, k, v, log_gates=log_gates, form=form, chunk_size=4, **ids)

    inputs = normal(4, (B, T, N, H)), normal(5, (B, T, K, H)), normal(6, (B, T, K, H))
    inputs += (-jnp.abs(normal(7, (B, T, N))),)
    _packed_and_alone(fn, inputs, normal(8, (B, T, N, H)), **SEGMENT_IDS)


@pytest.mark.parametrize("form", attn.DELTA_FORMS)
def test_delta_rule_packed_equals_each_segment_alone(form):
    def fn(q, k, v, beta, log_gates, **ids):
        return attn.delta_rule(q, k, v, beta, log_gates=log_gates, form=form, chunk_size=4, **ids)

    q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in qk_pair(10))
    beta = jax.nn.sigmoid(normal(12, (B, T, N)))
    inputs = (q, k, normal(11, (B, T, N, H)), beta, -jnp.abs(normal(13, (B, T, N))))
    _packed_and_alone(fn, inputs, normal(14, (B, T, N, H)), **SEGMENT_IDS)


def qk_pair(seed):
    return normal(seed, (B, T, K, H)), normal((seed, 1), (B, T, K, H))


def test_short_conv_packed_equals_each_segment_alone():
    def loss(x, weight, cot, **ids):
        y = attn.short_conv(x, weight, **ids)[0]
        return (y * cot).sum(), y

    run = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    x, weight, cot = normal(8, (B, T, 6)), normal(9, (4, 6)), normal(15, (B, T, 6))
    (dx, dw), y = run(_poisoned(x), weight, cot, segment_ids=jnp.asarray(IDS))
    (want_dx, want_dw), want = run(_alone(x), weight, _alone(cot))
    assert rel_err(y, _packed(want)) <= RTOL
    assert rel_err(dx, _packed(want_dx)) <= RTOL and rel_err(dw, want_dw) <= RTOL


REFUSING = {
    **{
        impl: lambda ids, impl=impl: attend(impl)(*_qkv(), q_segment_ids=ids, kv_segment_ids=ids)
        for impl in impls_with(*SMALL_FLOAT32)
    },
    "linear": lambda ids: attn.linear_attention(*_qkv(), q_segment_ids=ids, kv_segment_ids=ids),
    "conv": lambda ids: attn.short_conv(jnp.zeros((B, T, 6)), jnp.ones((4, 6)), segment_ids=ids),
}


@pytest.mark.parametrize("call", REFUSING)
def test_negative_ids_are_refused(call):
    with pytest.raises(ValueError, match=r"segment_ids: expected ids >= 0"):
        REFUSING[call](jnp.asarray(IDS) - 1)


def _qkv():
    return jnp.zeros((B, T, N, H)), jnp.zeros((B, T, K, H)), jnp.zeros((B, T, K, H))
