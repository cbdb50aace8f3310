"""Short causal depthwise convolutions: the definition, decode state and packing.

Oracle: a float64 NumPy loop written from the definition (a per-row history
of the current segment's real inputs), independent of the packed-gather
implementation. Shapes are few and small to keep compilation down.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.conv import short_conv, short_conv_step
from tests.util import normal, rel_err

RTOL = 1e-5  # float32, relative norm-wise error |a-b|/|b|
BF16_RTOL = 1e-2
B, T, D = 2, 7, 3
WIDTHS = (1, 2, 4)
# Row 0: two segments with padding inside the first, between them and at the
# end; an id that comes back (1 after 2) starts a new segment. Row 1: left
# padding, then one segment.
SEGMENTS = np.array([[1, 0, 1, 2, 2, 1, 0], [0, 0, 3, 3, 3, 3, 3]], np.int32)


def np_short_conv(x, weight, bias=None, state=None, segment_ids=None):
    """Float64 loop: each row keeps the inputs of its current segment, oldest first."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    Bx, Tx, Dx = x.shape
    W = weight.shape[0]
    bias = np.zeros(Dx) if bias is None else np.asarray(bias, np.float64)
    seg = np.ones((Bx, Tx), np.int64) if segment_ids is None else np.asarray(segment_ids)
    y = np.zeros((Bx, Tx, Dx))
    new_state = np.zeros((Bx, W - 1, Dx))
    for b in range(Bx):
        history = [] if state is None else list(np.asarray(state, np.float64)[b])
        current = None  # the state continues whatever segment comes first
        for t in range(Tx):
            if seg[b, t] == 0:
                continue  # padding: as if absent
            if current is not None and seg[b, t] != current:
                history = []  # a new segment starts with an empty window
            current = seg[b, t]
            history.append(x[b, t])
            window = [np.zeros(Dx)] * W + history
            y[b, t] = bias + sum(weight[j] * window[len(window) - W + j] for j in range(W))
        if W > 1:
            new_state[b] = np.stack(([np.zeros(Dx)] * (W - 1) + history)[-(W - 1) :])
    return y, new_state


def inputs(seed, W, dtype=jnp.float32, length=T):
    x = normal((seed, 0), (B, length, D), dtype)
    weight = normal((seed, 1), (W, D))
    bias = normal((seed, 2), (D,))
    state = normal((seed, 3), (B, W - 1, D), dtype)
    return x, weight, bias, state


@pytest.mark.parametrize("W", WIDTHS)
def test_matches_numpy_loop(W):
    x, weight, bias, state = inputs(0, W)
    cases = [(None, None, None), (bias, state, None), (bias, state, SEGMENTS)]
    for case_bias, case_state, seg in cases:
        y, new_state = short_conv(x, weight, case_bias, state=case_state, segment_ids=seg)
        want_y, want_state = np_short_conv(x, weight, case_bias, case_state, seg)
        assert y.dtype == x.dtype and new_state.dtype == x.dtype
        assert new_state.shape == (B, W - 1, D)
        assert rel_err(y, want_y) <= RTOL, (case_bias is None, seg is None)
        np.testing.assert_array_equal(new_state, want_state.astype(np.float32))
    # Tap order: weight[W-1] multiplies the current token, weight[0] the oldest.
    impulse = jnp.zeros((1, W + 1, 1)).at[0, 0, 0].set(1.0)
    taps = jnp.arange(1.0, W + 1)[:, None]
    y, _ = short_conv(impulse, taps)
    np.testing.assert_array_equal(y[0, :W, 0], taps[::-1, 0])


@pytest.mark.parametrize("W", WIDTHS)
def test_prefill_then_decode_equals_full_forward(W):
    x, weight, bias, _ = inputs(1, W)
    full_y, full_state = short_conv(x, weight, bias)
    # Prefill chunks shorter than W-1 (1 token, then 2) carry the state's
    # older inputs forward; then token-by-token decode.
    ys, state = [], None
    for start, stop in ((0, 1), (1, 3)):
        y, state = short_conv(x[:, start:stop], weight, bias, state=state)
        ys.append(y)
    step = jax.jit(short_conv_step)
    for t in range(3, T):
        y_t, state = step(state, x[:, t], weight, bias)
        ys.append(y_t[:, None])
    assert rel_err(jnp.concatenate(ys, axis=1), full_y) <= RTOL
    np.testing.assert_array_equal(state, full_state)

    # With segment ids (row 1: left padding, then one segment; a step continues
    # the state's sequence and never resets it): a padding step outputs 0 and
    # leaves the state as it was.
    seg = SEGMENTS[1:]
    seg_y, seg_state = short_conv(x[1:], weight, bias, segment_ids=seg)
    ys, state = [], jnp.zeros((1, W - 1, D))
    for t in range(T):
        y_t, state = step(state, x[1:, t], weight, bias, segment_id=seg[:, t])
        ys.append(y_t[:, None])
    assert rel_err(jnp.concatenate(ys, axis=1), seg_y) <= RTOL
    np.testing.assert_array_equal(state, seg_state)


def test_packed_equals_per_segment_runs():
    W = 4
    x, weight, bias, state = inputs(2, W, length=10)
    seg = np.array([[1, 1, 1, 2, 2, 0, 3, 3, 3, 3], [5, 5, 0, 0, 5, 5, 5, 7, 0, 0]], np.int32)
    # Each segment's real tokens, padding skipped.
    pieces = {0: [[0, 1, 2], [3, 4], [6, 7, 8, 9]], 1: [[0, 1, 4, 5, 6], [7]]}
    y, new_state = short_conv(x, weight, bias, state=state, segment_ids=seg)
    for b, rows in pieces.items():
        for i, idx in enumerate(rows):
            past = state[b : b + 1] if i == 0 else None  # the state is the first segment's
            want, want_state = short_conv(x[b : b + 1, idx], weight, bias, state=past)
            assert rel_err(y[b, idx], want[0]) <= RTOL, (b, i)
        np.testing.assert_array_equal(new_state[b], want_state[0])  # the last segment's
        padding = seg[b] == 0
        np.testing.assert_array_equal(y[b, padding], 0.0)
    # A row of padding only keeps its state.
    _, kept = short_conv(x, weight, bias, state=state, segment_ids=np.zeros_like(seg))
    np.testing.assert_array_equal(kept, state)


@pytest.mark.parametrize("segments", [False, True])
def test_gradients_match_float64(segments):
    W = 4
    x, weight, bias, state = inputs(3, W)
    seg = SEGMENTS if segments else None
    dy = normal((3, 4), (B, T, D))
    dstate = normal((3, 5), (B, W - 1, D))

    def loss(x, weight, bias, state):
        y, new_state = short_conv(x, weight, bias, state=state, segment_ids=seg)
        return jnp.sum(y * dy.astype(y.dtype)) + jnp.sum(new_state * dstate.astype(y.dtype))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, weight, bias, state)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in (x, weight, bias, state)]
        want = jax.grad(loss, argnums=(0, 1, 2, 3))(*args64)
    for name, g, w in zip(("x", "weight", "bias", "state"), grads, want, strict=True):
        assert g.dtype == jnp.float32
        assert rel_err(g, w) <= RTOL, name
    if segments:  # padding inputs are never read
        np.testing.assert_array_equal(grads[0][SEGMENTS == 0], 0.0)


def test_bf16_jit_and_vmap():
    W = 4
    x, weight, bias, state = inputs(4, W, dtype=jnp.bfloat16)
    y, new_state = jax.jit(short_conv)(x, weight, bias, state=state, segment_ids=SEGMENTS)
    want_y, want_state = np_short_conv(x, weight, bias, state, SEGMENTS)
    assert y.dtype == jnp.bfloat16 and new_state.dtype == jnp.bfloat16
    assert rel_err(y, want_y) <= BF16_RTOL
    np.testing.assert_array_equal(new_state.astype(np.float32), want_state)

    # vmap over a stack of independent calls (e.g. q, k and v with their own taps).
    xs = jnp.stack([x, 2 * x, -x]).astype(jnp.float32)
    weights = jnp.stack([weight, -weight, 0.5 * weight])
    ys, states = jax.vmap(lambda a, w: short_conv(a, w, bias, segment_ids=SEGMENTS))(xs, weights)
    for i in range(3):
        want_y, want_state = short_conv(xs[i], weights[i], bias, segment_ids=SEGMENTS)
        assert rel_err(ys[i], want_y) <= RTOL
        np.testing.assert_array_equal(states[i], want_state)


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        (dict(x=jnp.zeros((B, T))), "x"),
        (dict(x=jnp.zeros((B, 0, D))), "x"),
        (dict(x=jnp.zeros((B, T, D), jnp.int32)), "x"),
        (dict(weight=jnp.zeros((4,))), "weight"),
        (dict(weight=jnp.zeros((0, D))), "weight"),
        (dict(weight=jnp.zeros((4, D + 1))), "weight"),
        (dict(bias=jnp.zeros((D + 1,))), "bias"),
        (dict(state=jnp.zeros((B, 4, D))), "state"),
        (dict(state=jnp.zeros((B, 3, D + 1))), "state"),
        (dict(segment_ids=jnp.zeros((B, T), jnp.float32)), "segment_ids"),
        (dict(segment_ids=jnp.zeros((B, T + 1), jnp.int32)), "segment_ids"),
    ],
)
def test_bad_input_raises(kwargs, arg):
    call = dict(x=jnp.zeros((B, T, D)), weight=jnp.zeros((4, D)), bias=None) | kwargs
    x, weight, bias = call.pop("x"), call.pop("weight"), call.pop("bias")
    with pytest.raises(ValueError, match=f"^{arg}: expected"):
        short_conv(x, weight, bias, **call)


def test_step_bad_input_raises_and_export():
    state, weight = jnp.zeros((B, 3, D)), jnp.zeros((4, D))
    with pytest.raises(ValueError, match=r"^x_t: expected"):
        short_conv_step(state, jnp.zeros((B, 1, D)), weight)
    with pytest.raises(ValueError, match=r"^state: expected"):
        short_conv_step(None, jnp.zeros((B, D)), weight)
    with pytest.raises(ValueError, match=r"^segment_id: expected"):
        short_conv_step(state, jnp.zeros((B, D)), weight, segment_id=jnp.ones((B, 1), jnp.int32))
    assert attn.short_conv is short_conv and attn.short_conv_step is short_conv_step
