"""Log-linear attention and log-linear Gated DeltaNet: their forms and decoding against
float64 oracles from the paper's equations.

The oracles do not call the library. The Fenwick levels come from the paper's
partition of the prefix, walked bucket by bucket (``fenwick_level``), checked
against a bit loop; the outputs and final states from a float64 NumPy loop over
``(t, s)`` that runs each segment alone (for the delta rule, ``q_t^T Phi(s -> t)``
multiplied out transition by transition); the gradients from the same sums
written in ``jnp`` and run in float64 (their level table from ``fenwick_level``).
q and k are shared by groups of value heads and T is a multiple of no chunk.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.linear import (
    LOG_LINEAR_DELTA_FORMS,
    LOG_LINEAR_FORMS,
    delta_rule,
    init_log_linear_state,
    log_linear_attention,
    log_linear_attention_step,
    log_linear_delta_rule,
    log_linear_delta_rule_step,
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


def segments_of(ids_row):
    """Token indices of each segment: runs of equal non-zero ids, padding skipped."""
    runs, current = [], None
    for t, i in enumerate(ids_row):
        if i == 0:
            continue
        if i != current:
            runs.append([])
            current = i
        runs[-1].append(t)
    return runs


def np_log_linear(q, k, v, log_a, lam, scale, ids=None):
    """Outputs ``[B,T,N,E]`` and the final Fenwick states ``[B,N,L,H,E]`` (of the last
    segment, seen from its last token) as a float64 loop over each segment alone."""
    q, k, v, log_a, lam = (np.asarray(x, np.float64) for x in (q, k, v, log_a, lam))
    b_, t_ = q.shape[:2]
    L = lam.shape[-1]
    out = np.zeros((b_, t_, N, E))
    states = np.zeros((b_, N, L, H, E))
    heads = np.arange(N) // G
    for b in range(b_):
        runs = [list(range(t_))] if ids is None else segments_of(ids[b])
        for tokens in runs:
            for i, t in enumerate(tokens):
                for j, s in enumerate(tokens[: i + 1]):
                    level = min(fenwick_level(i, j), L - 1)
                    decay = np.exp(log_a[b, tokens[j + 1 : i + 1]].sum(0))  # [N]
                    score = np.einsum("nh,nh->n", q[b, t, heads], k[b, s, heads]) * scale
                    out[b, t] += (lam[b, t, :, level] * decay * score)[:, None] * v[b, s]
        if runs:
            tokens, last = runs[-1], len(runs[-1]) - 1
            for j, s in enumerate(tokens):
                level = min(fenwick_level(last, j), L - 1)
                decay = np.exp(log_a[b, tokens[j + 1 :]].sum(0))
                write = k[b, s, heads][:, :, None] * v[b, s][:, None, :]
                states[b, :, level] += decay[:, None, None] * write
    return out, states


def jnp_log_linear(q, k, v, log_a, lam, scale):
    """The masked sum in ``jnp`` (no segments), for float64 gradients."""
    t_, L = q.shape[1], lam.shape[-1]
    table = np.array([[fenwick_level(t, s) if s <= t else 0 for s in range(t_)] for t in range(t_)])
    hot = jnp.asarray(np.minimum(table, L - 1)[..., None] == np.arange(L), q.dtype)  # [T,S,L]
    causal = jnp.asarray(np.tril(np.ones((t_, t_), bool)))
    total = jnp.cumsum(log_a, axis=1)  # float64: differences are exact enough here
    log_decay = total[:, :, None] - total[:, None, :]  # [B,T,S,N]
    causal = causal[None, :, :, None]
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, log_decay, 0.0)), 0.0)
    weight = jnp.einsum("btnl,tsl->btsn", lam, hot) * decay
    qn, kn = jnp.repeat(q, G, axis=2), jnp.repeat(k, G, axis=2)
    scores = jnp.einsum("btnh,bsnh->btsn", qn, kn) * scale
    return jnp.einsum("btsn,bsne->btne", scores * weight, v)


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
    scale = H**-0.5
    want_out, want_states = np_log_linear(*args, scale)
    rng = np.random.default_rng(seed + 1)
    cotangent = rng.standard_normal((Bt, length, N, E)).astype(np.float32)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(x, jnp.float64) for x in args]

        def loss64(*xs):
            return jnp.sum(jnp_log_linear(*xs, scale) * cotangent)

        want_grads = jax.jit(jax.grad(loss64, argnums=range(5)))(*args64)
        want_grads = [np.asarray(g) for g in want_grads]
        out64 = np.asarray(jnp_log_linear(*args64, scale))
    assert rel_err(out64, want_out) <= 1e-12  # the oracles agree

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
    want_out, want_states = np_log_linear(q, k, v, log_a, lam, H**-0.5, ids)
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
    want_out, want_states = np_log_linear(*args, H**-0.5)
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


@pytest.mark.integration
def test_zero_gates_erase_without_nan():
    """Decays of exactly 0 (``log_a = -inf``) inside and at the edges of chunks: every form
    gives the quadratic form's outputs, states and gradients, all finite; so do both forms
    of log-linear Gated DeltaNet."""
    args = list(make_inputs(7, T))
    log_a = args[3]
    log_a[0, [0, 7, 8, 20], 0] = -np.inf  # the first token, a chunk's last and next first
    log_a[1, 15:18, :] = -np.inf
    rng = np.random.default_rng(8)
    cotangent = rng.standard_normal((Bt, T, N, E)).astype(np.float32)

    def loss(*xs, form):
        out, state = log_linear_attention(*xs, form=form, chunk_size=C, return_state=True)
        return jnp.sum(out * cotangent) + jnp.sum(state.levels), (out, state.levels)

    results = {}
    for form in LOG_LINEAR_FORMS:
        run = jax.jit(jax.grad(partial(loss, form=form), argnums=range(5), has_aux=True))
        results[form] = run(*args)
    want_grads, want = results["quadratic"]
    for form, (grads, got) in results.items():
        names = (*ARG_NAMES, "out", "levels")
        for name, g, w in zip(names, (*grads, *got), (*want_grads, *want), strict=True):
            g = np.asarray(g)
            assert np.isfinite(g).all(), (form, name)
            assert rel_err(g, w) <= (GRAD_RTOL if name in ARG_NAMES else RTOL), (form, name)
    # Log-linear Gated DeltaNet with the same gates: its two forms agree, all finite.
    q, k, v, beta, lam, _ = make_delta_inputs(9, T)

    def delta_loss(q, k, v, beta, lam, log_g, form):
        out, state = log_linear_delta_rule(
            q, k, v, beta, lam, log_gates=log_g, form=form, chunk_size=C, return_state=True
        )
        return jnp.sum(out * cotangent) + jnp.sum(state.levels), (out, state.levels)

    results = {}
    for form in LOG_LINEAR_DELTA_FORMS:
        run = jax.jit(jax.grad(partial(delta_loss, form=form), argnums=range(6), has_aux=True))
        results[form] = run(q, k, v, beta, lam, log_a)
    want_grads, want = results["recurrent"]
    grads, got = results["chunkwise"]
    names = (*DELTA_NAMES, "out", "levels")
    for name, g, w in zip(names, (*grads, *got), (*want_grads, *want), strict=True):
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.isfinite(w).all(), name
        assert rel_err(g, w) <= (RTOL if name in ("out", "levels") else GRAD_RTOL), name


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
    assert attn.log_linear_attention is log_linear_attention


# ----------------------------------------------------------------------------
# Log-linear Gated DeltaNet

DELTA_NAMES = ("q", "k", "v", "beta", "level_weights", "log_gates")
DELTA_STEP = jax.jit(log_linear_delta_rule_step)


def make_delta_inputs(seed, length=T, levels=7):
    """Unit-norm q and k, beta in (0.1, 1.5): q, k, v, beta, level weights, log gates."""
    q, k, v, log_g, lam = make_inputs(seed, length, levels)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    beta = np.random.default_rng(seed + 100).uniform(0.1, 1.5, (Bt, length, N))
    return q, k, v, beta.astype(np.float32), lam, log_g


def np_delta(q, k, v, beta, lam, log_g, scale, ids=None):
    """Outputs and final states as a float64 loop over each segment alone: for query t the
    row ``q_t^T Phi(s -> t)`` is built from s = t down, times each transition
    ``A_s = a_s (I - beta_s k_s k_s^T)`` in turn; the final state's level l sums
    ``Phi(s -> last) beta_s k_s v_s^T`` over its bucket."""
    q, k, v, beta, lam, log_g = (np.asarray(x, np.float64) for x in (q, k, v, beta, lam, log_g))
    b_, t_ = q.shape[:2]
    L = lam.shape[-1]
    out = np.zeros((b_, t_, N, E))
    states = np.zeros((b_, N, L, H, E))
    for b in range(b_):
        runs = [list(range(t_))] if ids is None else segments_of(ids[b])
        for n in range(N):
            keys, a = k[b, :, n // G], np.exp(log_g[b, :, n])
            for tokens in runs:
                for i, t in enumerate(tokens):
                    row = q[b, t, n // G] * scale
                    for j in range(i, -1, -1):
                        s = tokens[j]
                        weight = lam[b, t, n, min(fenwick_level(i, j), L - 1)]
                        out[b, t, n] += weight * (row @ keys[s]) * beta[b, s, n] * v[b, s, n]
                        row = a[s] * (row - beta[b, s, n] * (row @ keys[s]) * keys[s])
            if runs:
                tokens = runs[-1]
                for j, s in enumerate(tokens):
                    column = beta[b, s, n] * keys[s]
                    for r in tokens[j + 1 :]:
                        column = a[r] * (column - beta[b, r, n] * (keys[r] @ column) * keys[r])
                    level = min(fenwick_level(len(tokens) - 1, j), L - 1)
                    states[b, n, level] += np.outer(column, v[b, s, n])
    return out, states


def jnp_delta(q, k, v, beta, lam, log_g, scale):
    """The same sum in ``jnp`` (no segments): a reverse scan over s carries the rows
    ``q_t^T Phi(s -> t)`` of every query t, each step multiplying them by ``A_s``."""
    t_, L = q.shape[1], lam.shape[-1]
    table = np.array([[fenwick_level(t, s) if s <= t else 0 for s in range(t_)] for t in range(t_)])
    hot = jnp.asarray(np.minimum(table, L - 1)[..., None] == np.arange(L), q.dtype)  # [T,S,L]
    qn, kn = jnp.repeat(q, G, axis=2) * scale, jnp.repeat(k, G, axis=2)  # [B,T,N,H]
    rows_t = jnp.arange(t_)[:, None]

    def back(R, x):  # R [B,N,T,H]: q_t^T Phi(s -> t) for t >= s
        s, q_s, k_s, beta_s, g_s = x
        R = jnp.where(rows_t == s, q_s[:, :, None], R)
        dots = jnp.einsum("bnth,bnh->bnt", R, k_s)
        column = jnp.where(jnp.arange(t_) >= s, dots * beta_s[..., None], 0.0)
        R = jnp.exp(g_s)[..., None, None] * (
            R - (beta_s[..., None] * dots)[..., None] * k_s[:, :, None]
        )
        return R, column

    xs = (jnp.arange(t_), *(jnp.moveaxis(x, 1, 0) for x in (qn, kn, beta, log_g)))
    init = jnp.zeros((q.shape[0], N, t_, H), q.dtype)
    _, columns = jax.lax.scan(back, init, xs, reverse=True)  # [S,B,N,T]
    weight = jnp.einsum("btnl,tsl->bnts", lam, hot)
    return jnp.einsum("sbnt,bnts,bsne->btne", columns, weight, v)


def _check_delta(form, chunk, length=T, levels=7, seed=10, gated=True):
    args = list(make_delta_inputs(seed, length, levels))
    if not gated:
        args[5] = np.zeros_like(args[5])
    scale = H**-0.5
    want_out, want_states = np_delta(*args, scale)
    cotangent = np.random.default_rng(seed + 1).standard_normal((Bt, length, N, E))
    with jax.enable_x64(True):
        args64 = [jnp.asarray(x, jnp.float64) for x in args]

        def loss64(*xs):
            return jnp.sum(jnp_delta(*xs, scale) * cotangent)

        want_grads = [np.asarray(g) for g in jax.jit(jax.grad(loss64, argnums=range(6)))(*args64)]
        assert rel_err(jnp_delta(*args64, scale), want_out) <= 1e-12  # the oracles agree

    def loss(q, k, v, beta, lam, log_g):
        out, state = log_linear_delta_rule(
            q, k, v, beta, lam, log_gates=log_g if gated else None, form=form,
            chunk_size=chunk, return_state=True,
        )  # fmt: skip
        return jnp.sum(out * cotangent), (out, state)

    grads, (out, state) = jax.jit(jax.grad(loss, argnums=range(6), has_aux=True))(*args)
    what = f"{form} C={chunk} T={length} L={levels} gated={gated}"
    assert rel_err(out, want_out) <= RTOL, what
    assert rel_err(state.levels, want_states) <= RTOL, what
    names = DELTA_NAMES if gated else DELTA_NAMES[:5]
    for name, got, want in zip(names, grads, want_grads, strict=False):
        assert rel_err(got, want) <= GRAD_RTOL, f"{what}: d{name}"


def test_delta_chunkwise_matches_float64_forward_and_gradients():
    """Log-linear Gated DeltaNet, chunks of 8 over 37 tokens: outputs, final states and the
    gradients of all six arguments."""
    _check_delta("chunkwise", C)


@pytest.mark.integration
@pytest.mark.parametrize("form", LOG_LINEAR_DELTA_FORMS)
def test_delta_forms_match_float64_forward_and_gradients(form):
    """Both forms: chunks of 4, 8 and 64 > T, 70 tokens, clamped levels, one token, and
    DeltaNet without gates."""
    for chunk, length, levels, gated in (
        (8, T, 7, True), (4, 70, 8, True), (64, 37, 3, True), (8, 1, 2, True), (8, 29, 6, False),
    ):  # fmt: skip
        _check_delta(form, chunk, length, levels, seed=length + levels, gated=gated)


@pytest.mark.integration
@pytest.mark.parametrize("form", LOG_LINEAR_DELTA_FORMS)
def test_delta_packed_equals_each_segment_alone_and_decodes_on(form):
    """Packed segments with NaN padding: each segment alone, padding reaches nothing; the
    last segment's state continues by steps; steps from the empty state equal the oracle."""
    length = IDS.shape[1]
    q, k, v, beta, lam, log_g = make_delta_inputs(12, length + EXTRA)
    ids = np.concatenate([IDS, np.repeat([[3], [7]], EXTRA, axis=1)], axis=1)
    pad = ids == 0
    q, k, v, lam = (np.where(pad[..., None, None], np.nan, x) for x in (q, k, v, lam))
    beta, log_g = (np.where(pad[..., None], np.nan, x) for x in (beta, log_g))
    want_out, want_states = np_delta(q, k, v, beta, lam, log_g, H**-0.5, ids)
    args = [x[:, :length] for x in (q, k, v, beta, lam, log_g)]

    def loss(q, k, v, beta, lam, log_g):
        out, state = log_linear_delta_rule(
            q, k, v, beta, lam, log_gates=log_g, form=form, chunk_size=C, return_state=True,
            q_segment_ids=IDS, kv_segment_ids=IDS,
        )  # fmt: skip
        return jnp.sum(out), (out, state)

    grads, (out, state) = jax.jit(jax.grad(loss, argnums=range(6), has_aux=True))(*args)
    np.testing.assert_array_equal(np.asarray(out)[IDS == 0], 0.0)
    assert rel_err(out, want_out[:, :length]) <= RTOL
    for name, g in zip(DELTA_NAMES, grads, strict=True):
        g = np.asarray(g)
        assert np.isfinite(g).all(), name
        np.testing.assert_array_equal(g[IDS == 0], 0.0, err_msg=name)
    ones = np.ones((Bt,), np.int32)
    for t in range(length, length + EXTRA):
        step_args = [x[:, t] for x in (q, k, v, beta, lam)]
        out_t, state = DELTA_STEP(*step_args, state, log_gates=log_g[:, t], segment_id=ones)
        assert rel_err(out_t, want_out[:, t]) <= RTOL, t
    assert rel_err(state.levels, want_states) <= RTOL
    # From the empty state, token by token (no padding in these rows).
    args = make_delta_inputs(13, 19)
    want_out, want_states = np_delta(*args, H**-0.5)
    state = init_log_linear_state(Bt, N, H, E, args[4].shape[-1])
    for t in range(19):
        step_args = [x[:, t] for x in args[:5]]
        out_t, state = DELTA_STEP(*step_args, state, log_gates=args[5][:, t], segment_id=ones)
        assert rel_err(out_t, want_out[:, t]) <= RTOL, t
    assert rel_err(state.levels, want_states) <= RTOL


@pytest.mark.integration
def test_delta_unit_weights_are_gated_deltanet():
    """All level weights 1 (any number of levels) is ``attn.delta_rule``, gated or not."""
    q, k, v, beta, _, log_g = make_delta_inputs(14, 27)
    for gates in (log_g, None):
        want = delta_rule(q, k, v, beta, log_gates=gates, form="recurrent")
        for form in LOG_LINEAR_DELTA_FORMS:
            run = jax.jit(partial(log_linear_delta_rule, form=form, chunk_size=8))
            for levels in (1, 4):
                ones = np.ones((Bt, 27, N, levels), np.float32)
                assert rel_err(run(q, k, v, beta, ones, log_gates=gates), want) <= RTOL


def test_delta_bad_input_is_named():
    q, k, v, beta, lam, log_g = make_delta_inputs(15, 5, levels=3)
    good = dict(q=q, k=k, v=v, beta=beta, level_weights=lam, log_gates=log_g)
    cases = [
        (dict(beta=beta[..., :2]), "beta"),
        (dict(beta=np.full_like(beta, np.inf)), "beta"),
        (dict(log_gates=-log_g + 0.1), "log_gates"),
        (dict(log_gates=log_g[:, :4]), "log_gates"),
        (dict(level_weights=-lam), "level_weights"),
        (dict(form="quadratic"), "form"),
        (dict(chunk_size=48), "chunk_size"),
        (dict(v=v[:, :, :3]), "v"),
        (dict(initial_state=init_log_linear_state(Bt, N, H, E, 3)), "initial_state"),
    ]
    for change, arg in cases:
        with pytest.raises(ValueError, match=f"^{arg}: expected"):
            log_linear_delta_rule(**{**good, **change})
    state = init_log_linear_state(Bt, N, H, E, 2)
    with pytest.raises(ValueError, match=r"^state: expected"):
        log_linear_delta_rule_step(*(x[:, 0] for x in (q, k, v, beta, lam)), state)


def test_initial_state_continues_the_sequence():
    """A chunked prefill in the recurrent form: from the empty state and then from the
    first call's returned state it equals the float64 oracle over the concatenation, and
    steps from that state, for log-linear attention and the delta rule. Row 0's second
    chunk is all padding (NaN; state and length kept); row 1 continues its segment, starts
    a fresh one and ends in padding."""
    half = 6
    ids = np.array([[1] * half + [0] * half, [1] * half + [1, 1, 2, 2, 2, 0]], np.int32)
    cases = (
        (log_linear_attention, STEP, make_inputs(16, 2 * half, levels=4), np_log_linear),
        (log_linear_delta_rule, DELTA_STEP, make_delta_inputs(17, 2 * half, levels=4), np_delta),
    )
    for fn, step, args, oracle in cases:
        pad = ids == 0
        args = [np.where(pad.reshape(*pad.shape, *(1,) * (x.ndim - 2)), np.nan, x) for x in args]
        want, want_state = oracle(*args, H**-0.5, ids)
        gated = fn is log_linear_delta_rule  # the log gates, last, as a keyword
        run = jax.jit(partial(fn, form="recurrent", return_state=True))
        state = init_log_linear_state(Bt, N, H, E, 4)
        outs = []
        for part in (slice(0, half), slice(half, None)):
            xs = [x[:, part] for x in args]
            keywords = dict(log_gates=xs.pop()) if gated else {}
            out, end = run(
                *xs, **keywords, initial_state=state,
                q_segment_ids=ids[:, part], kv_segment_ids=ids[:, part],
            )  # fmt: skip
            outs.append(out)
            state, start = end, state
        assert rel_err(np.concatenate(outs, axis=1), want) <= RTOL
        np.testing.assert_array_equal(np.asarray(outs[1])[ids[:, half:] == 0], 0.0)
        assert rel_err(state.levels, want_state) <= RTOL
        np.testing.assert_array_equal(state.levels[0], start.levels[0])
        np.testing.assert_array_equal(state.length, [half, 3])
        for t in range(half, half + 2):  # steps: row 0 padding, row 1 continuing
            xs = [x[:, t] for x in args]
            keywords = dict(log_gates=xs.pop()) if gated else {}
            out_t, start = step(*xs, start, **keywords, segment_id=ids[:, t])
            assert rel_err(out_t, outs[1][:, t - half]) <= RTOL, t
