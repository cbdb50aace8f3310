"""Log-linear Gated DeltaNet: its forms, packing and decoding against the library's float64
reference (``attn.linear.reference.log_linear_delta_rule``); a gate of 0 and a chunked
prefill, for it and log-linear attention. Inputs and helpers are ``test_log_linear``'s.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.linear import (
    LOG_LINEAR_DELTA_FORMS,
    LOG_LINEAR_FORMS,
    delta_rule,
    init_log_linear_state,
    log_linear_attention,
    log_linear_delta_rule,
    log_linear_delta_rule_step,
)
from tests.attn.linear.test_log_linear import (
    ARG_NAMES,
    EXTRA,
    GRAD_RTOL,
    IDS,
    RTOL,
    STEP,
    Bt,
    C,
    E,
    H,
    N,
    T,
    float64_grads,
    make_inputs,
    oracle,
)  # fmt: skip
from tests.util import rel_err

DELTA_NAMES = ("q", "k", "v", "beta", "level_weights", "log_gates")
DELTA_STEP = jax.jit(log_linear_delta_rule_step)


def make_delta_inputs(seed, length=T, levels=7):
    """Unit-norm q and k, beta in (0.1, 1.5): q, k, v, beta, level weights, log gates."""
    q, k, v, log_g, lam = make_inputs(seed, length, levels)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    beta = np.random.default_rng(seed + 100).uniform(0.1, 1.5, (Bt, length, N))
    return q, k, v, beta.astype(np.float32), lam, log_g


def _check_delta(form, chunk, length=T, levels=7, seed=10, gated=True):
    args = list(make_delta_inputs(seed, length, levels))
    if not gated:
        args[5] = np.zeros_like(args[5])
    want_out, want_states = oracle(args, delta=True)
    cotangent = np.random.default_rng(seed + 1).standard_normal((Bt, length, N, E))
    want_grads = float64_grads(args, cotangent, delta=True)

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
    want_out, want_states = oracle((q, k, v, beta, lam, log_g), ids, delta=True)
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
    want_out, want_states = oracle(args, delta=True)
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


def test_initial_state_continues_the_sequence():
    """A chunked prefill in the recurrent form: from the empty state and then from the
    first call's returned state it equals the float64 oracle over the concatenation, and
    steps from that state, for log-linear attention and the delta rule. Row 0's second
    chunk is all padding (NaN; state and length kept); row 1 continues its segment, starts
    a fresh one and ends in padding."""
    half = 6
    ids = np.array([[1] * half + [0] * half, [1] * half + [1, 1, 2, 2, 2, 0]], np.int32)
    cases = (
        (log_linear_attention, STEP, make_inputs(16, 2 * half, levels=4)),
        (log_linear_delta_rule, DELTA_STEP, make_delta_inputs(17, 2 * half, levels=4)),
    )
    for fn, step, args in cases:
        pad = ids == 0
        args = [np.where(pad.reshape(*pad.shape, *(1,) * (x.ndim - 2)), np.nan, x) for x in args]
        want, want_state = oracle(args, ids, delta=fn is log_linear_delta_rule)
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
