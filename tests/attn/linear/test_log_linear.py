"""Log-linear attention: its forms and decoding against the library's float64 reference.

The reference (``attn.linear.reference.log_linear_attention``, the masked
quadratic sum of the paper's equation, run on each packed segment alone by
``reference.each_segment``) gives outputs, final states and, by ``jax.grad`` in
float64, the gradients. Its Fenwick levels, and the forms', are checked against
the paper's partition of the prefix walked bucket by bucket (``fenwick_level``)
and a bit loop. q and k are shared by groups of value heads and T is a multiple
of no chunk. Log-linear Gated DeltaNet is ``test_log_linear_delta.py``'s.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.linear import (
    LOG_LINEAR_FORMS,
    init_log_linear_state,
    log_linear_attention,
    log_linear_attention_step,
    reference,
    ssd,
)
from attn.linear.log_linear_forms import fenwick_levels
from tests.util import rel_err

RTOL = 1e-5
GRAD_RTOL = 1e-4
Bt, K, G, H, E = 2, 2, 2, 8, 8  # batch, query/key heads, value heads per kv head, dims
N = K * G
T = 37  # 6 levels beyond level 0; no multiple of the chunk
C = 8
ARG_NAMES = ("q", "k", "v", "log_a", "level_weights")


def fenwick_level(t: int, s: int) -> int:
    """The paper's partition of ``[0, t]`` seen from t: level 0 is t itself; walking up
    from level 1, where bit ``l - 1`` of t is set, the next ``2^(l-1)`` positions below
    the part already covered form level l."""
    assert 0 <= s <= t
    if s == t:
        return 0
    covered, level = t, 1
    while True:
        if (t >> (level - 1)) & 1:
            low = covered - (1 << (level - 1))
            if low <= s < covered:
                return level
            covered = low
        level += 1


def bit_loop_level(t: int, s: int) -> int:
    """Shifts until t and s agree: the number of bits up to the highest one they differ in."""
    level = 0
    while t != s:
        t, s, level = t >> 1, s >> 1, level + 1
    return level


def make_inputs(seed, length=T, levels=7, b=Bt):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, length, K, H)).astype(np.float32)
    k = rng.standard_normal((b, length, K, H)).astype(np.float32)
    v = rng.standard_normal((b, length, N, E)).astype(np.float32)
    log_a = -rng.uniform(0.0, 0.4, (b, length, N)).astype(np.float32)
    log_a[:, length // 3, 0] = 0.0  # a decay of exactly 1
    lam = rng.uniform(0.1, 1.5, (b, length, N, levels)).astype(np.float32)
    lam[:, :, 1, min(2, levels - 1)] = 0.0  # a level switched off
    return q, k, v, log_a, lam


def oracle(args, ids=None, delta=False):
    """Float64 outputs and final Fenwick states from the library's reference of log-linear
    attention (or of its delta rule), each segment alone where ``ids`` are given."""
    fn = reference.log_linear_delta_rule if delta else reference.log_linear_attention
    with jax.enable_x64(True):
        args = [np.asarray(x, np.float64) for x in args]
        if ids is not None:
            return reference.each_segment(fn, ids, *args, scale=H**-0.5)
        out, state = fn(*map(jnp.asarray, args), scale=H**-0.5)
        return np.asarray(out), np.asarray(state)


def float64_grads(args, cotangent, delta=False):
    """The reference's gradients of ``sum(out * cotangent)`` for every argument, float64."""
    fn = reference.log_linear_delta_rule if delta else reference.log_linear_attention
    with jax.enable_x64(True):

        def loss64(*xs):
            return jnp.sum(fn(*xs, scale=H**-0.5)[0] * cotangent)

        args64 = [jnp.asarray(x, jnp.float64) for x in args]
        grads = jax.jit(jax.grad(loss64, argnums=range(len(args))))(*args64)
        return [np.asarray(g) for g in grads]


def test_levels_are_the_fenwick_partition():
    """The walk over the paper's buckets, the bit loop and the library's levels agree; each
    query sees level 0 and at most ``bit_length(t)`` more buckets, each contiguous."""
    n = 70
    walked = np.array([[fenwick_level(t, s) if s <= t else 0 for s in range(n)] for t in range(n)])
    looped = np.array([[bit_loop_level(t, s) if s <= t else 0 for s in range(n)] for t in range(n)])
    np.testing.assert_array_equal(walked, looped)
    t, s = (jnp.asarray(x) for x in np.meshgrid(np.arange(n), np.arange(n), indexing="ij"))
    ours = np.asarray(fenwick_levels(t, s, 100))
    np.testing.assert_array_equal(np.where(s <= t, ours, 0), walked)
    np.testing.assert_array_equal(np.tril(reference.fenwick_levels(n, 100)), walked)
    clamped = np.asarray(fenwick_levels(t, s, 3))  # 3 levels: 2 and above share level 2
    np.testing.assert_array_equal(clamped, np.minimum(ours, 2))
    for q_pos in range(n):
        row = walked[q_pos, : q_pos + 1]
        assert len(set(row)) == bin(q_pos).count("1") + 1 <= q_pos.bit_length() + 1
        for level in set(row):  # each bucket is a contiguous run of positions
            at = np.flatnonzero(row == level)
            assert at[-1] - at[0] + 1 == len(at)
    assert walked[6, 4] == walked[6, 5] == 2 and walked[6, 0] == walked[6, 3] == 3


def _check_against_float64(form, chunk, length=T, levels=7, seed=0):
    """Outputs, final states and the gradients of all five arguments against the oracles."""
    args = make_inputs(seed, length, levels)
    want_out, want_states = oracle(args)
    rng = np.random.default_rng(seed + 1)
    cotangent = rng.standard_normal((Bt, length, N, E)).astype(np.float32)
    want_grads = float64_grads(args, cotangent)

    def loss(*xs):
        out, state = log_linear_attention(*xs, form=form, chunk_size=chunk, return_state=True)
        return jnp.sum(out * cotangent), (out, state)

    grads, (out, state) = jax.jit(jax.grad(loss, argnums=range(5), has_aux=True))(*args)
    what = f"{form} C={chunk} T={length} L={levels}"
    assert out.dtype == jnp.float32 and state.levels.dtype == jnp.float32
    assert rel_err(out, want_out) <= RTOL, what
    assert rel_err(state.levels, want_states) <= RTOL, what
    np.testing.assert_array_equal(state.length, [length] * Bt)
    for name, got, want in zip(ARG_NAMES, grads, want_grads, strict=True):
        assert rel_err(got, want) <= GRAD_RTOL, f"{what}: d{name}"


def test_chunkwise_matches_float64_forward_and_gradients():
    """Chunks of 8 over 37 tokens (5 chunks, 3 levels across chunks), every level its own
    weight: outputs, final states and every gradient."""
    _check_against_float64("chunkwise", C)


@pytest.mark.integration
@pytest.mark.parametrize("form", LOG_LINEAR_FORMS)
def test_forms_match_float64_forward_and_gradients(form):
    """Each form against the oracles: every level its own weight over 37 and 70 tokens, the
    levels clamped to 3 (levels 2.. share the last weight), chunks of 4, 8 and 64 > T, and
    a single token."""
    for chunk, length, levels in ((8, T, 7), (4, 70, 8), (64, 37, 3), (8, 1, 2)):
        _check_against_float64(form, chunk, length, levels, seed=length + levels)


IDS = np.array(
    [
        [1] * 9 + [2] * 4 + [3] * 17 + [0] * 2,
        [0, 0] + [5] * 3 + [0] + [6] * 19 + [0] + [6] * 4 + [7] * 2,
    ],
    np.int32,
)
STEP = jax.jit(log_linear_attention_step)
EXTRA = 3  # tokens decoded after a packed forward


def _check_packed(form):
    """A packed, padded batch is each segment alone (levels counted from the segment's
    start); the final state is the last segment's and decoding continues it; padding holds
    NaN, outputs 0 and reaches no output and no gradient."""
    length = IDS.shape[1]
    q, k, v, log_a, lam = make_inputs(2, length + EXTRA)
    ids = np.concatenate([IDS, np.repeat([[3], [7]], EXTRA, axis=1)], axis=1)  # the last ones
    pad = (ids == 0)[..., None, None]
    q, k, v = (np.where(pad, np.nan, x) for x in (q, k, v))
    log_a, lam = np.where(pad[..., 0], np.nan, log_a), np.where(pad, np.nan, lam)
    want_out, want_states = oracle((q, k, v, log_a, lam), ids)
    args = [x[:, :length] for x in (q, k, v, log_a, lam)]

    def loss(*xs):
        out, state = log_linear_attention(
            *xs, form=form, chunk_size=C, return_state=True, q_segment_ids=IDS, kv_segment_ids=IDS
        )
        return jnp.sum(out), (out, state)

    grads, (out, state) = jax.jit(jax.grad(loss, argnums=range(5), has_aux=True))(*args)
    np.testing.assert_array_equal(np.asarray(out)[IDS == 0], 0.0)
    assert rel_err(out, want_out[:, :length]) <= RTOL
    np.testing.assert_array_equal(state.length, [17, 2])
    for name, g in zip(ARG_NAMES, grads, strict=True):
        g = np.asarray(g)
        assert np.isfinite(g).all(), name
        np.testing.assert_array_equal(g[IDS == 0], 0.0, err_msg=name)
    ones = np.ones((Bt,), np.int32)
    for t in range(length, length + EXTRA):
        out_t, state = STEP(
            q[:, t], k[:, t], v[:, t], log_a[:, t], lam[:, t], state, segment_id=ones
        )
        assert rel_err(out_t, want_out[:, t]) <= RTOL, t
    assert rel_err(state.levels, want_states) <= RTOL
    np.testing.assert_array_equal(state.length, [17 + EXTRA, 2 + EXTRA])


def test_packed_chunkwise_equals_each_segment_alone():
    """The chunkwise form over its aligned layout of the segments (see ``_check_packed``)."""
    _check_packed("chunkwise")


@pytest.mark.integration
@pytest.mark.parametrize("form", ["quadratic", "recurrent"])
def test_packed_equals_each_segment_alone(form):
    _check_packed(form)


def test_decoding_equals_the_oracle():
    """Steps from the empty state give the oracle's outputs and final state; after t tokens
    exactly ``popcount(t - 1) + 1 <= floor(log2 t) + 2`` levels are non-zero. A padding step
    (holding NaN) changes nothing and outputs 0."""
    length = 21
    args = make_inputs(3, length)
    want_out, want_states = oracle(args)
    state = init_log_linear_state(Bt, N, H, E, args[-1].shape[-1])
    ones = np.ones((Bt,), np.int32)
    for t in range(length):
        out_t, state = STEP(*(x[:, t] for x in args), state, segment_id=ones)
        assert rel_err(out_t, want_out[:, t]) <= RTOL, t
        live = np.any(np.asarray(state.levels) != 0, axis=(1, 3, 4)).sum(-1)
        assert (live == bin(t).count("1") + 1).all() and (live <= int(np.log2(t + 1)) + 2).all()
        if t == 12:  # a padding step in row 0
            first = [np.arange(Bt).reshape(-1, *(1,) * (x.ndim - 2)) == 0 for x in args]
            nan_args = [np.where(f, np.nan, x[:, t]) for f, x in zip(first, args, strict=True)]
            out_p, padded = STEP(*nan_args, state, segment_id=np.array([0, 1], np.int32))
            np.testing.assert_array_equal(np.asarray(out_p)[0], 0.0)
            np.testing.assert_array_equal(np.asarray(padded.levels)[0], np.asarray(state.levels)[0])
            np.testing.assert_array_equal(padded.length, [t + 1, t + 2])
    assert rel_err(state.levels, want_states) <= RTOL
    np.testing.assert_array_equal(state.length, [length] * Bt)


@pytest.mark.integration
def test_unit_weights_are_gated_linear_attention():
    """All level weights 1 (any number of levels) is Mamba-2's SSD: C, B, dt x, dt A."""
    length = 23
    q, k, v, _, _ = make_inputs(4, length)
    rng = np.random.default_rng(5)
    dt = rng.uniform(0.05, 0.8, (Bt, length, N)).astype(np.float32)
    A = -rng.uniform(0.3, 1.5, (N,)).astype(np.float32)
    want = ssd(v, dt, A, k, q, form="chunkwise", chunk_size=8)
    for form in LOG_LINEAR_FORMS:
        run = jax.jit(partial(log_linear_attention, form=form, scale=1.0, chunk_size=8))
        for levels in (1, 3, 6):
            ones = np.ones((Bt, length, N, levels), np.float32)
            got = run(q, k, v * dt[..., None], dt * A, ones)
            assert rel_err(got, want) <= RTOL, (form, levels)


def test_bad_input_is_named():
    q, k, v, log_a, lam = make_inputs(6, 5, levels=3)
    good = dict(q=q, k=k, v=v, log_a=log_a, level_weights=lam)
    cases = [
        (dict(q=q[0]), "q"),
        (dict(q=q.astype(np.int32)), "q"),
        (dict(k=k[:, :4]), "k"),
        (dict(v=v[:, :, :3]), "v"),  # 3 value heads for 2 kv heads
        (dict(log_a=log_a[..., :2]), "log_a"),
        (dict(log_a=-log_a + 0.1), "log_a"),
        (dict(log_a=np.full_like(log_a, np.nan)), "log_a"),
        (dict(level_weights=lam[..., 0]), "level_weights"),
        (dict(level_weights=lam[..., :0]), "level_weights"),
        (dict(level_weights=-lam), "level_weights"),
        (dict(level_weights=np.full_like(lam, np.inf)), "level_weights"),
        (dict(form="parallel"), "form"),
        (dict(chunk_size=12), "chunk_size"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(scale=-1.0), "scale"),
        (dict(q_segment_ids=np.ones((2, 5), np.int32)), "q_segment_ids/kv_segment_ids"),
        (dict(q_segment_ids=np.ones((2, 4), np.int32), kv_segment_ids=np.ones((2, 4), np.int32)),
         "q_segment_ids"),
    ]  # fmt: skip
    state = init_log_linear_state(Bt, N, H, E, 3)
    for form in ("quadratic", "chunkwise"):
        cases.append((dict(initial_state=state, form=form), "initial_state"))
    wrong = init_log_linear_state(Bt, N, H, E, 4)
    cases.append((dict(initial_state=wrong, form="recurrent"), "initial_state"))
    for change, arg in cases:
        with pytest.raises(ValueError, match=f"^{arg}: expected"):
            log_linear_attention(**{**good, **change})
    assert state.levels.shape == (Bt, N, 3, H, E) and state.levels.dtype == jnp.float32
    step_args = [x[:, 0] for x in (q, k, v, log_a, lam)]
    with pytest.raises(ValueError, match=r"^state: expected"):
        log_linear_attention_step(*step_args, init_log_linear_state(Bt, N, H, E, 4))
    with pytest.raises(ValueError, match=r"^level_weights: expected"):
        log_linear_attention_step(*step_args[:4], -step_args[4], state)
    # Integer weights (refused as the DPLR rule refuses integer gates) and a state length
    # that counts no tokens (-3, 1.5) were taken.
    with pytest.raises(ValueError, match=r"^level_weights: expected real floating-point"):
        log_linear_attention(**{**good, "level_weights": np.ones(lam.shape, np.int32)})
    for length, want in ((np.full(Bt, -3, np.int32), "counts >= 0"), (np.full(Bt, 1.5), "int")):
        with pytest.raises(ValueError, match=rf"^state\.length: expected .*{want}"):
            log_linear_attention_step(*step_args, state._replace(length=jnp.asarray(length)))
    assert attn.log_linear_attention is log_linear_attention
