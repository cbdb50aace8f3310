"""The delta rule: both forms against a float64 recurrence, forward and gradients.

The oracle is the library's reference (``attn.linear.reference.delta_rule``,
written from the equations of ``attn.linear.delta``'s docstring: per head, decay
the state, ``u = beta (v - S^T k)``, ``S += k u^T``, read ``S^T (scale q)``, as a
``lax.scan`` over tokens) run in float64 for outputs and states; its
``jax.grad`` is the gradient oracle, and ``reference.each_segment_jnp`` runs it
on each packed segment alone. Every case has grouped value heads (G = 2), a
non-zero initial state and a length that is a multiple of no chunk size tried.
Compiles dominate, so each test builds few programs.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.linear import DELTA_FORMS, delta_rule, delta_rule_step, init_delta_state, reference
from tests.util import rel_err

RTOL = 1e-5  # outputs and states, float32 against float64
GRAD_RTOL = 1e-4
BF16_RTOL = 1e-2
B, K, G, H, E = 2, 2, 2, 8, 6
N = K * G
GATES = ("none", "head", "channel")  # DeltaNet, Gated DeltaNet, KDA


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed, T, gate, *, b=B, beta_max=0.95):
    """q, k ``[B,T,K,H]`` (unit norm), v ``[B,T,N,E]``, beta ``[B,T,N]``, log gates, state.

    ``beta_max`` above 1 reaches the negative eigenvalues ``1 - beta`` of the
    write (Grazzi et al.'s beta in (0, 2)).
    """
    rng = np.random.default_rng(seed)
    q = unit(rng.standard_normal((b, T, K, H))).astype(np.float32)
    k = unit(rng.standard_normal((b, T, K, H))).astype(np.float32)
    v = rng.standard_normal((b, T, N, E)).astype(np.float32)
    beta = rng.uniform(0.05, beta_max, (b, T, N)).astype(np.float32)
    shape = {"none": None, "head": (b, T, N), "channel": (b, T, N, H)}[gate]
    g = None if shape is None else (-rng.uniform(0.0, 0.4, shape)).astype(np.float32)
    if gate == "head" and T > 7:
        g[:, 7, 0] = -np.inf  # the edge value: a gate of 0 forgets the state
    state = rng.standard_normal((b, N, H, E)).astype(np.float32)
    return q, k, v, beta, g, state


# ----------------------------------------------------------------------------
# float64 oracles


def jnp_delta(q, k, v, beta, g, state, scale=H**-0.5):
    """The library's reference (``attn.linear.reference``), run in float64 for the gradients."""
    return reference.delta_rule(q, k, v, beta, g, initial_state=state, scale=scale)


def np_oracle(q, k, v, beta, g, state):
    """``jnp_delta``'s float64 outputs and final state as NumPy."""
    with jax.enable_x64(True):
        x64 = [
            None if a is None else jnp.asarray(a, jnp.float64) for a in (q, k, v, beta, g, state)
        ]
        return tuple(np.asarray(a) for a in jax.jit(jnp_delta)(*x64))


def oracle_grads(args, cotangents):
    """Float64 gradients of ``<out, do> + <state, dS>`` w.r.t. q, k, v, beta, g, state."""
    with jax.enable_x64(True):
        x64 = [None if a is None else jnp.asarray(np.asarray(a), jnp.float64) for a in args]
        do, dS = (jnp.asarray(c, jnp.float64) for c in cotangents)

        def loss(*xs):
            out, S = jnp_delta(*xs)
            return jnp.sum(out * do) + jnp.sum(S * dS)

        argnums = tuple(i for i, a in enumerate(x64) if a is not None)
        grads = jax.jit(jax.grad(loss, argnums=argnums))(*x64)
        return dict(zip(argnums, (np.asarray(x) for x in grads), strict=True))


def ours_with_grads(args, cotangents, **kw):
    """Output, final state and gradients of ``delta_rule`` (float32, jitted)."""
    do, dS = cotangents
    argnums = tuple(i for i, a in enumerate(args) if a is not None)

    def run(q, k, v, beta, g, state):
        return delta_rule(q, k, v, beta, log_gates=g, initial_state=state, return_state=True, **kw)

    def loss(*xs):
        out, S = run(*xs)
        return jnp.sum(out * do) + jnp.sum(S * dS), (out, S)

    grads, primals = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(*args)
    return primals, dict(zip(argnums, grads, strict=True))


ARG_NAMES = ("q", "k", "v", "beta", "log_gates", "initial_state")
T_LONG = 45  # a multiple of no chunk size below


@pytest.mark.parametrize(
    "gate, beta_max",
    [*((g, 0.95) for g in GATES), ("head", 1.95)],
    ids=[*GATES, "head-negative-eigenvalues"],
)
def test_forms_match_float64_forward_and_gradients(gate, beta_max):
    args = make_inputs(0, T_LONG, gate, beta_max=beta_max)
    rng = np.random.default_rng(1)
    cotangents = (rng.standard_normal((B, T_LONG, N, E)), rng.standard_normal((B, N, H, E)))
    cotangents = tuple(c.astype(np.float32) for c in cotangents)
    want_out, want_S = np_oracle(*args)
    want_grads = oracle_grads(args, cotangents)
    # C = 16 is one substitution block; C = 64 > T merges four by halves, over padding.
    for form, chunk in (("recurrent", 64), ("chunkwise", 16), ("chunkwise", 64)):
        (out, S), grads = ours_with_grads(args, cotangents, form=form, chunk_size=chunk)
        what = f"{form} C={chunk}"
        assert out.dtype == jnp.float32 and S.dtype == jnp.float32
        assert rel_err(out, want_out) <= RTOL, what
        assert rel_err(S, want_S) <= RTOL, what
        for i, grad in grads.items():
            assert rel_err(grad, want_grads[i]) <= GRAD_RTOL, f"{what}: d{ARG_NAMES[i]}"


def test_beta_near_two_over_long_sequences():
    """beta in (1.9, 2) (eigenvalues near -1) for 2048 tokens without a gate: the state
    stays bounded (a reflection), chunkwise equals the float64 recurrence, gradients finite."""
    T = 2048
    q, k, v, beta, _, state = make_inputs(9, T, "none", b=1)
    beta = np.random.default_rng(10).uniform(1.9, 2.0, beta.shape).astype(np.float32)
    want_out, want_S = np_oracle(q, k, v, beta, None, state[:1])

    def loss(q, k, v, beta):
        out, S = delta_rule(q, k, v, beta, initial_state=state[:1], return_state=True)
        return jnp.sum(out[:, -64:] ** 2) + jnp.sum(S**2), (out, S)

    grads, (out, S) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, beta)
    assert np.abs(want_S).max() < 100  # bounded: no growth over 2048 reflections
    assert rel_err(out, want_out) <= 1e-4 and rel_err(S, want_S) <= 1e-4
    assert all(np.isfinite(g).all() for g in grads)


def test_one_token_and_the_step():
    """T = 1 in both forms, and ``delta_rule_step`` iterated over T tokens, per gate kind."""
    T = 5
    for gate in GATES:
        q, k, v, beta, g, state = make_inputs(2, T, gate)
        want_out, want_S = np_oracle(q, k, v, beta, g, state)
        step = jax.jit(delta_rule_step)
        S = jnp.asarray(state)
        for t in range(T):
            g_t = None if g is None else g[:, t]
            out_t, S = step(q[:, t], k[:, t], v[:, t], beta[:, t], S, log_gates=g_t)
            assert rel_err(out_t, want_out[:, t]) <= RTOL, (gate, t)
        assert rel_err(S, want_S) <= RTOL, gate
        one = [x[:, :1] for x in (q, k, v, beta)]
        g_1 = None if g is None else g[:, :1]
        first, first_S = np_oracle(*one, g_1, state)
        for form in DELTA_FORMS:
            run = jax.jit(partial(delta_rule, form=form, return_state=True))
            out, S1 = run(*one, log_gates=g_1, initial_state=state)
            assert rel_err(out, first) <= RTOL and rel_err(S1, first_S) <= RTOL, (gate, form)


def test_identities_between_the_variants():
    """Gated DeltaNet with g = 0 is DeltaNet; KDA with one gate on every channel is
    Gated DeltaNet; beta = 0 writes nothing."""
    q, k, v, beta, g, state = make_inputs(3, T_LONG, "head")
    run = jax.jit(partial(delta_rule, return_state=True, chunk_size=16))
    plain = run(q, k, v, beta, initial_state=state)
    zero_gate = run(q, k, v, beta, log_gates=np.zeros_like(g), initial_state=state)
    for a, b in zip(plain, zero_gate, strict=True):
        assert rel_err(a, b) <= 1e-6
    per_head = run(q, k, v, beta, log_gates=g, initial_state=state)
    channels = np.broadcast_to(g[..., None], (*g.shape, H))
    per_channel = run(q, k, v, beta, log_gates=channels, initial_state=state)
    for a, b in zip(per_head, per_channel, strict=True):
        assert rel_err(a, b) <= RTOL
    out, S = run(q, k, v, np.zeros_like(beta), initial_state=state)
    np.testing.assert_array_equal(S, state)  # no write, no decay: the state as it was
    want = np.einsum("btnh,bnhe->btne", np.repeat(q, G, 2).astype(np.float64), state) * H**-0.5
    assert rel_err(out, want) <= RTOL


def test_zero_gates_erase_without_nan():
    """A gate of exactly 0 (log gate -inf) erases the state: finite outputs and gradients,
    and nothing from before it reaches the outputs after it."""
    for gate in ("head", "channel"):
        q, k, v, beta, g, state = make_inputs(4, 20, gate)
        g = g.copy()
        g[:, 7] = -np.inf
        want_out, want_S = np_oracle(q, k, v, beta, g, state)
        for form in DELTA_FORMS:
            run = partial(delta_rule, log_gates=g, form=form, chunk_size=8, return_state=True)

            def after(q, k, v, state, run=run, beta=beta):
                out, S = run(q, k, v, beta, initial_state=state)
                return jnp.sum(out[:, 7:] ** 2) + jnp.sum(S**2), (out, S)

            grads, (out, S) = jax.jit(jax.grad(after, argnums=(0, 1, 2, 3), has_aux=True))(
                q, k, v, state
            )
            assert rel_err(out, want_out) <= RTOL and rel_err(S, want_S) <= RTOL, (gate, form)
            assert all(np.isfinite(x).all() for x in grads), (gate, form)
            np.testing.assert_array_equal(grads[3], 0.0)
            np.testing.assert_array_equal(grads[2][:, :7], 0.0)


# Packed rows: segments of 11, 3 and 5 tokens then padding; and 5 tokens, padding,
# a segment with padding inside (it spans chunks), 3 tokens, padding. Chunks of 8.
IDS = np.array(
    [
        [1] * 11 + [2] * 3 + [3] * 5 + [0] * 3,
        [7] * 5 + [0] + [8] * 6 + [0] + [8] * 5 + [9] * 3 + [0],
    ],
    np.int32,
)


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_packed_equals_each_segment_alone(gate):
    """Forward and gradients: a packed, padded batch is each segment run by itself (by the
    float64 reference). The initial state is the first segment's past."""
    T = IDS.shape[1]
    q, k, v, beta, g, state = make_inputs(5, T, gate)
    rng = np.random.default_rng(6)
    do = rng.standard_normal((B, T, N, E)).astype(np.float32)

    def packed_loss(q, k, v, beta, g, state, form):
        out = delta_rule(
            q,
            k,
            v,
            beta,
            log_gates=g,
            form=form,
            chunk_size=8,
            initial_state=state,
            q_segment_ids=IDS,
            kv_segment_ids=IDS,
        )
        return jnp.sum(out * do), out

    segments = [  # (row, token indices) of every segment
        (b, np.flatnonzero(IDS[b] == seg)) for b in range(B) for seg in dict.fromkeys(IDS[b]) if seg
    ]

    def alone(q, k, v, beta, g, state):  # the reference on each segment alone
        out, _ = reference.each_segment_jnp(
            reference.delta_rule, IDS, q, k, v, beta, g, initial_state=state
        )
        return jnp.sum(out * do), out

    args = (q, k, v, beta, g, state)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(x, jnp.float64) for x in args]
        want_grads, want = jax.jit(jax.grad(alone, argnums=range(6), has_aux=True))(*args64)
        want_grads, want = [np.asarray(x) for x in want_grads], np.asarray(want)
    for form in DELTA_FORMS:
        loss = partial(packed_loss, form=form)
        grads, out = jax.jit(jax.grad(loss, argnums=range(6), has_aux=True))(*args)
        for b, where in segments:
            assert rel_err(out[b, where], want[b, where]) <= RTOL, form
        np.testing.assert_array_equal(np.asarray(out)[IDS == 0], 0.0)
        for i in range(6):
            assert rel_err(grads[i], want_grads[i]) <= GRAD_RTOL, f"{form}: d{ARG_NAMES[i]}"
        for i in range(5):  # padding tokens get no gradient
            np.testing.assert_array_equal(np.asarray(grads[i])[IDS == 0], 0.0)


def test_bf16_inputs_keep_a_float32_state():
    q, k, v, beta, g, state = make_inputs(7, T_LONG, "head")
    want_out, want_S = np_oracle(
        *(x.astype(jnp.bfloat16).astype(np.float64) for x in (q, k, v, beta)), g, state
    )
    lo = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, beta)]
    for form in DELTA_FORMS:
        out, S = jax.jit(partial(delta_rule, form=form, return_state=True))(
            *lo, log_gates=g, initial_state=state
        )
        assert out.dtype == jnp.bfloat16 and S.dtype == jnp.float32
        assert rel_err(out.astype(jnp.float32), want_out) <= BF16_RTOL, form
        assert rel_err(S, want_S) <= BF16_RTOL, form


def test_zero_state_helper():
    S = init_delta_state(2, N, H, E)
    assert S.shape == (2, N, H, E) and S.dtype == jnp.float32 and not S.any()


def _bad_calls():
    q, k, v, beta, g, state = make_inputs(8, 4, "head")
    T = 4
    return (
        [
            (dict(q=q[0]), "q"),
            (dict(k=k[:, :, :1]), "k"),
            (dict(v=v[:, :, :3]), "v"),  # 3 value heads: not a multiple of K = 2
            (dict(beta=beta[..., :1]), "beta"),
            (dict(beta=beta[..., None]), "beta"),
            (dict(beta=np.where(np.arange(T)[:, None] == 2, np.inf, beta)), "beta"),  # NaN state
            (dict(beta=np.full_like(beta, np.nan)), "beta"),
            (dict(log_gates=g[..., :1]), "log_gates"),
            (dict(log_gates=np.abs(g)), "log_gates"),
            (dict(chunk_size=0), "chunk_size"),
            (dict(form="parallel"), "form"),
            (dict(initial_state=state[:, :1]), "initial_state"),
            (dict(q_segment_ids=np.ones((B, T), np.int32)), "q_segment_ids/kv_segment_ids"),
            (dict(scale=-1.0), "scale"),
            (dict(q=q.astype(np.int32)), "q"),
        ],
        dict(q=q, k=k, v=v, beta=beta),
    )


def test_bad_input_names_the_argument():
    cases, good = _bad_calls()
    for change, arg in cases:
        kw = {**good, **change}
        q, k, v, beta = (kw.pop(n) for n in ("q", "k", "v", "beta"))
        with pytest.raises(ValueError, match=f"^{arg}: expected"):
            delta_rule(q, k, v, beta, **kw)
    q, k, v, beta = (good[n][:, 0] for n in ("q", "k", "v", "beta"))
    S = init_delta_state(B, N, H, E)
    with pytest.raises(ValueError, match=r"^state: expected"):
        delta_rule_step(q, k, v, beta, S[:, :1])
    with pytest.raises(ValueError, match=r"^beta: expected"):
        delta_rule_step(q, k, v, beta[:, :1], S)
