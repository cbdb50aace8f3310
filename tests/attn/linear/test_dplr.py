"""The DPLR delta rule: both forms against a float64 recurrence, forward and gradients.

The oracle is the library's reference (``attn.linear.reference.dplr_delta_rule``,
written from the equations of ``attn.linear.dplr``'s docstring: per value head
``S <- diag(w) S + b (a^T S) + k v^T``, read ``S^T (scale q)``, as a ``lax.scan``
over tokens) run in float64 for outputs and states, on each packed segment alone
(``reference.each_segment_jnp``: the row's first segment continues from the
initial state, the others start from zeros, padding is skipped); its ``jax.grad``
is the gradient oracle. The inputs are RWKV-7's (``a = -kappa``, ``b = kappa *
a_in``, ``log_w`` in (-0.6, 0) with a few ``-inf`` and a stretch of strong
decays) with grouped value heads (G = 2): ``a`` per query/key head, ``b`` per
value head. Lengths are multiples of no chunk size tried. Compiles dominate, so
each test builds few programs.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.linear import (
    DPLR_FORMS,
    delta_rule,
    dplr,
    dplr_delta_rule,
    dplr_delta_rule_step,
    reference,
)
from attn.linear.delta import init_delta_state
from tests.util import rel_err

RTOL = 1e-5  # outputs and states, float32 against float64
GRAD_RTOL = 1e-4
BF16_RTOL = 1e-2
B, K, G, H, E = 2, 2, 2, 8, 6
N = K * G
ARG_NAMES = ("q", "k", "v", "a", "b", "log_w", "initial_state")


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed, T, *, b=B):
    """q, k ``[B,T,K,H]``, v ``[B,T,N,E]``, a ``[B,T,K,H]``, b, log_w ``[B,T,N,H]``, state.

    RWKV-7's transition: ``a = -kappa`` (unit norm, per query/key head), ``b = kappa
    * a_in`` with ``a_in`` in [0, 1] per value head; ``log_w`` in (-0.6, 0), zero
    decays (``-inf``) on a few channels at token 7, and decays below ``e^-20`` a
    token from token 12 to 16: past ``e^-100`` in all, where ``e^{-gamma}`` of the
    running sums gamma would overflow float32.
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, T, K, H)).astype(np.float32)
    k = (0.5 * rng.standard_normal((b, T, K, H))).astype(np.float32)
    v = rng.standard_normal((b, T, N, E)).astype(np.float32)
    kappa = unit(rng.standard_normal((b, T, K, H)))
    a_in = rng.uniform(0.0, 1.0, (b, T, N, H))
    a = (-kappa).astype(np.float32)
    bb = (np.repeat(kappa, G, axis=2) * a_in).astype(np.float32)
    log_w = -rng.uniform(0.0, 0.6, (b, T, N, H))
    if T > 17:
        log_w[:, 7, 0, :3] = -np.inf
        log_w[:, 12:17] -= 20.0
    state = rng.standard_normal((b, N, H, E)).astype(np.float32)
    return q, k, v, a, bb, log_w.astype(np.float32), state


# ----------------------------------------------------------------------------
# float64 oracles


def ref_dplr(q, k, v, a, b, log_w, state, ids=None):
    """The library's reference from ``state``, each segment alone where ``ids`` are given."""
    fn = partial(reference.dplr_delta_rule, scale=H**-0.5)
    if ids is None:
        return fn(q, k, v, a, b, log_w, initial_state=state)
    return reference.each_segment_jnp(fn, ids, q, k, v, a, b, log_w, initial_state=state)


def np_oracle(*args):
    """``ref_dplr``'s float64 outputs and final state as NumPy."""
    with jax.enable_x64(True):
        x64 = [jnp.asarray(x, jnp.float64) for x in args]
        return tuple(np.asarray(x) for x in jax.jit(ref_dplr)(*x64))


def oracle_grads(args, cotangents, ids=None):
    """Float64 ``(out, state)`` and gradients of ``<out, do> + <state, dS>`` w.r.t. every arg."""
    with jax.enable_x64(True):
        x64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in args]
        do, dS = (jnp.asarray(c, jnp.float64) for c in cotangents)

        def loss(*xs):
            out, S = ref_dplr(*xs, ids)
            return jnp.sum(out * do) + jnp.sum(S * dS), (out, S)

        grads, primals = jax.jit(jax.grad(loss, argnums=range(7), has_aux=True))(*x64)
        return [np.asarray(x) for x in primals], [np.asarray(x) for x in grads]


def ours_with_grads(args, cotangents, **kw):
    """Output, final state and gradients of ``dplr_delta_rule`` (float32, jitted)."""
    do, dS = cotangents

    def loss(q, k, v, a, b, log_w, state):
        out, S = dplr_delta_rule(q, k, v, a, b, log_w, initial_state=state, return_state=True, **kw)
        return jnp.sum(out * do) + jnp.sum(S * dS), (out, S)

    return jax.jit(jax.grad(loss, argnums=range(7), has_aux=True))(*args)


def cotangents_for(seed, T):
    rng = np.random.default_rng(seed)
    do = rng.standard_normal((B, T, N, E)).astype(np.float32)
    return do, rng.standard_normal((B, N, H, E)).astype(np.float32)


T_LONG = 37  # a multiple of no chunk size below


def test_forms_match_float64_forward_and_gradients():
    """Both forms, outputs, final state and every gradient. C = 32 is two chunks (the
    second padded), each two sub-chunks of 16."""
    args = make_inputs(0, T_LONG)
    cotangents = cotangents_for(1, T_LONG)
    (want_out, want_S), want_grads = oracle_grads(args, cotangents)
    for form, chunk in (("recurrent", 64), ("chunkwise", 32)):
        grads, (out, S) = ours_with_grads(args, cotangents, form=form, chunk_size=chunk)
        what = f"{form} C={chunk}"
        assert out.dtype == jnp.float32 and S.dtype == jnp.float32
        assert rel_err(out, want_out) <= RTOL, what
        assert rel_err(S, want_S) <= RTOL, what
        for name, grad, want in zip(ARG_NAMES, grads, want_grads, strict=True):
            assert rel_err(grad, want) <= GRAD_RTOL, f"{what}: d{name}"


# Packed rows: segments of 8, 3 and 5 tokens then padding; and 4 tokens, padding, a
# segment with padding inside (it spans the chunk boundary at 20), 2 tokens, padding.
IDS = np.array(
    [
        [1] * 8 + [2] * 3 + [3] * 5 + [0] * 6,
        [7] * 4 + [0] + [8] * 6 + [0] + [8] * 8 + [9] * 2,
    ],
    np.int32,
)


def test_packed_segments_with_nan_padding():
    """Forward and gradients of a packed, padded batch equal the float64 oracle's run of
    each segment alone; NaN in every input at the padding reaches nothing (outputs 0
    there, every gradient finite and 0 at the padding). C = 20: a sub-chunk padded."""
    T = IDS.shape[1]
    args = make_inputs(2, T)
    cotangents = cotangents_for(3, T)
    pad = IDS == 0
    clean = [x.copy() for x in args]
    for x in clean[:6]:
        x[pad] = 0.0  # what the oracle sees: padding never read
    dirty = [np.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), np.nan, x) for x in args[:6]]
    dirty.append(args[6])
    (want_out, want_S), want_grads = oracle_grads(clean, cotangents, IDS)
    for form, chunk in (("recurrent", 64), ("chunkwise", 20)):
        grads, (out, S) = ours_with_grads(
            dirty, cotangents, form=form, chunk_size=chunk, q_segment_ids=IDS, kv_segment_ids=IDS
        )
        assert rel_err(out, want_out) <= RTOL and rel_err(S, want_S) <= RTOL, form
        np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)
        for name, grad, want in zip(ARG_NAMES, grads, want_grads, strict=True):
            assert np.isfinite(grad).all(), f"{form}: d{name}"
            assert rel_err(grad, want) <= GRAD_RTOL, f"{form}: d{name}"
        for grad in grads[:6]:  # padding tokens get no gradient
            np.testing.assert_array_equal(np.asarray(grad)[pad], 0.0)


def test_one_token_and_the_step():
    """``dplr_delta_rule_step`` iterated over T tokens is the forward pass; T = 1 in both forms."""
    T = 5
    q, k, v, a, b, log_w, state = make_inputs(4, T)
    want_out, want_S = np_oracle(q, k, v, a, b, log_w, state)
    step = jax.jit(dplr_delta_rule_step)
    S = jnp.asarray(state)
    for t in range(T):
        out_t, S = step(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], log_w[:, t], S)
        assert out_t.dtype == jnp.float32 and S.dtype == jnp.float32
        assert rel_err(out_t, want_out[:, t]) <= RTOL, t
    assert rel_err(S, want_S) <= RTOL
    one = [x[:, :1] for x in (q, k, v, a, b, log_w)]
    first, first_S = np_oracle(*one, state)
    for form in DPLR_FORMS:
        run = jax.jit(partial(dplr_delta_rule, form=form, return_state=True))
        out, S1 = run(*one, initial_state=state)
        assert rel_err(out, first) <= RTOL and rel_err(S1, first_S) <= RTOL, form


def test_the_delta_rule_is_a_special_case():
    """``a = -beta (w * k)``, ``b = k``, values ``beta v``: ``attn.delta_rule`` with the same
    per-channel gates (KDA), and with none (w = 1, DeltaNet); beta per value head, so
    ``a`` has N heads and ``b`` K."""
    rng = np.random.default_rng(5)
    q, k, v, _, _, _, state = make_inputs(5, T_LONG)
    k = unit(k)
    beta = rng.uniform(0.05, 0.95, (B, T_LONG, N)).astype(np.float32)
    gates = (-rng.uniform(0.0, 0.4, (B, T_LONG, N, H))).astype(np.float32)
    dplr_run = jax.jit(
        partial(dplr_delta_rule, chunk_size=16, initial_state=state, return_state=True)
    )
    delta_run = jax.jit(partial(delta_rule, chunk_size=16, initial_state=state, return_state=True))
    for g in (gates, None):
        w = np.ones_like(gates) if g is None else np.exp(g)
        a = -beta[..., None] * w * np.repeat(k, G, axis=2)
        log_w = np.zeros_like(gates) if g is None else g
        got = dplr_run(q, k, beta[..., None] * v, a, k, log_w)
        want = delta_run(q, k, v, beta, log_gates=g)
        for x, y in zip(got, want, strict=True):
            assert rel_err(x, y) <= RTOL, "KDA" if g is not None else "DeltaNet"


def test_bf16_inputs_keep_a_float32_state():
    """bfloat16 inputs (the cast is the public function's, before either form)."""
    q, k, v, a, b, log_w, state = make_inputs(6, T_LONG)
    lo = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, a, b)]
    want_out, want_S = np_oracle(*(np.asarray(x.astype(jnp.float32)) for x in lo), log_w, state)
    out, S = jax.jit(partial(dplr_delta_rule, form="recurrent", return_state=True))(
        *lo, log_w, initial_state=state
    )
    assert out.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert rel_err(out.astype(jnp.float32), want_out) <= BF16_RTOL
    assert rel_err(S, want_S) <= BF16_RTOL


def _bad_calls():
    q, k, v, a, b, log_w, state = make_inputs(8, 4)
    T = 4
    at_2 = np.arange(T)[:, None, None] == 2
    return (
        [
            (dict(q=q[0]), "q"),
            (dict(k=k[:, :, :1]), "k"),
            (dict(v=v[:, :, :3]), "v"),  # 3 value heads: not a multiple of K = 2
            (dict(a=a[..., :1, :]), "a"),  # 1 head: neither K nor N
            (dict(a=a[..., :4]), "a"),
            (dict(b=b[0]), "b"),
            (dict(b=np.where(at_2, np.inf, b)), "b"),
            (dict(a=np.full_like(a, np.nan)), "a"),
            (dict(log_w=log_w[:, :, :K]), "log_w"),  # K heads: log_w is per value head
            (dict(log_w=np.abs(log_w) + 0.1), "log_w"),
            (dict(log_w=np.where(at_2, np.nan, log_w)), "log_w"),
            (dict(log_w=np.zeros(log_w.shape, np.int32)), "log_w"),
            (dict(chunk_size=0), "chunk_size"),
            (dict(form="parallel"), "form"),
            (dict(initial_state=state[:, :1]), "initial_state"),
            (dict(q_segment_ids=np.ones((B, T), np.int32)), "q_segment_ids/kv_segment_ids"),
            (dict(kv_segment_ids=np.ones((B, T + 1), np.int32)), "kv_segment_ids"),
            (dict(scale=-1.0), "scale"),
        ],
        dict(q=q, k=k, v=v, a=a, b=b, log_w=log_w),
    )


def test_bad_input_names_the_argument():
    cases, good = _bad_calls()
    names = ("q", "k", "v", "a", "b", "log_w")
    for change, arg in cases:
        kw = {**good, **change}
        arrays = [kw.pop(n) for n in names]
        with pytest.raises(ValueError, match=f"^{arg}: expected"):
            dplr_delta_rule(*arrays, **kw)
    q, k, v, a, b, log_w = (good[n][:, 0] for n in names)
    S = init_delta_state(B, N, H, E)
    with pytest.raises(ValueError, match=r"^state: expected"):
        dplr_delta_rule_step(q, k, v, a, b, log_w, S[:, :1])
    with pytest.raises(ValueError, match=r"^log_w: expected"):
        dplr_delta_rule_step(q, k, v, a, b, -log_w + 1.0, S)
    # NaN and -inf at padding are no error: the padding is never read.
    ids = np.ones((B, 4), np.int32)
    ids[:, 2] = 0
    a4, log_w4 = good["a"].copy(), good["log_w"].copy()
    a4[:, 2], log_w4[:, 2] = np.nan, np.nan
    dplr.check_values(a4, good["b"], log_w4, ids)
    with pytest.raises(ValueError, match=r"^a: expected"):
        dplr.check_values(a4, good["b"], log_w4)


# ----------------------------------------------------------------------------
# Integration: long sequences, every chunk size


@pytest.mark.integration
def test_long_sequences_and_chunk_sizes():
    """2048 tokens of RWKV-7's transition (a decay of e^-100 every 100 tokens): both forms
    against the float64 loop for several chunk sizes; gradients finite."""
    T = 2048
    q, k, v, a, b, log_w, state = make_inputs(9, T, b=1)
    log_w[:, ::100] -= 100.0
    want_out, want_S = np_oracle(q, k, v, a, b, log_w, state)
    for form, chunk in (("recurrent", 64), *(("chunkwise", c) for c in (1, 7, 16, 33, 64, 128))):
        run = jax.jit(partial(dplr_delta_rule, form=form, chunk_size=chunk, return_state=True))
        out, S = run(q, k, v, a, b, log_w, initial_state=state)
        assert rel_err(out, want_out) <= 1e-4 and rel_err(S, want_S) <= 1e-4, (form, chunk)

    def loss(*xs):
        out, S = dplr_delta_rule(*xs, initial_state=state, return_state=True)
        return jnp.sum(out[:, -64:] ** 2) + jnp.sum(S**2)

    grads = jax.jit(jax.grad(loss, argnums=range(6)))(q, k, v, a, b, log_w)
    assert all(np.isfinite(g).all() for g in grads)
