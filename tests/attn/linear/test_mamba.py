"""Mamba-2's SSD: its three forms against a float64 recurrence from the paper's equations.

The oracle is the library's reference (``attn.linear.reference.ssd``: Mamba-2's
recurrence per head, ``h <- a h + B (dt x)^T``, ``y = h^T C + D x``, ``a = exp(dt
A)`` or, with negative eigenvalues, ``2 exp(dt A) - 1``, as a ``lax.scan``) run in
float64 for outputs and states; its ``jax.grad`` gives the gradients of dt, A_log,
B, C, x, D and the initial state. B and C are shared by groups of heads and T
is a multiple of no chunk size used.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.linear import (
    SSD_FORMS,
    init_ssd_state,
    linear_attention,
    reference,
    ssd,
    ssd_decay,
    ssd_step,
)
from tests.util import rel_err

RTOL = 1e-5
GRAD_RTOL = 1e-4
Bt, K, G, H, E = 2, 2, 2, 6, 5  # batch, groups, heads per group, state dim, head dim
N = K * G
T_LONG = 45


def make_inputs(seed, T, *, b=Bt):
    """x ``[B,T,N,E]``, dt ``[B,T,N]``, A_log ``[N]``, B, C ``[B,T,K,H]``, D ``[N]``, h0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, T, N, E)).astype(np.float32)
    dt = rng.uniform(0.05, 1.0, (b, T, N)).astype(np.float32)
    dt[:, T // 2, 0] = 0.0  # the edge value: a step of length 0 keeps the state, adds nothing
    A_log = np.log(rng.uniform(0.3, 2.0, (N,))).astype(np.float32)
    Bm = rng.standard_normal((b, T, K, H)).astype(np.float32) * 0.5
    Cm = rng.standard_normal((b, T, K, H)).astype(np.float32) * 0.5
    D = rng.standard_normal((N,)).astype(np.float32)
    h0 = rng.standard_normal((b, N, H, E)).astype(np.float32)
    return x, dt, A_log, Bm, Cm, D, h0


def ref_ssd(x, dt, A_log, Bm, Cm, D, h0, negative=False):
    """The library's reference, A from A_log as the layer makes it (float64 under x64)."""
    return reference.ssd(
        x, dt, -jnp.exp(A_log), Bm, Cm, D, initial_state=h0, negative_eigenvalues=negative
    )


def np_oracle(*args, negative=False):
    """``ref_ssd``'s float64 outputs and final state as NumPy."""
    with jax.enable_x64(True):
        x64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
        return tuple(np.asarray(a) for a in ref_ssd(*x64, negative=negative))


ARG_NAMES = ("x", "dt", "A_log", "B", "C", "D", "initial_state")


def _loss(run, cotangents):
    dy, dh = cotangents

    def loss(x, dt, A_log, Bm, Cm, D, h0):
        y, h = run(x, dt, A_log, Bm, Cm, D, h0)
        return jnp.sum(y * dy) + jnp.sum(h * dh), (y, h)

    return loss


def oracle(args, cotangents, negative):
    """Float64 outputs, state and gradients of every argument."""
    with jax.enable_x64(True):
        x64 = [jnp.asarray(a, jnp.float64) for a in args]
        c64 = [jnp.asarray(c, jnp.float64) for c in cotangents]
        run = partial(ref_ssd, negative=negative)
        grads, (y, h) = jax.jit(jax.grad(_loss(run, c64), argnums=range(7), has_aux=True))(*x64)
        return np.asarray(y), np.asarray(h), [np.asarray(g) for g in grads]


def ours(args, cotangents, **kw):
    def run(x, dt, A_log, Bm, Cm, D, h0):
        return ssd(x, dt, -jnp.exp(A_log), Bm, Cm, D=D, initial_state=h0, return_state=True, **kw)

    loss = _loss(run, cotangents)
    grads, (y, h) = jax.jit(jax.grad(loss, argnums=range(7), has_aux=True))(*args)
    return y, h, grads


@pytest.mark.parametrize("negative", [False, True], ids=["decay", "negative"])
def test_forms_match_float64_forward_and_gradients(negative):
    args = make_inputs(0, T_LONG)
    rng = np.random.default_rng(1)
    cotangents = tuple(
        rng.standard_normal(s).astype(np.float32) for s in ((Bt, T_LONG, N, E), (Bt, N, H, E))
    )
    want_y, want_h, want_grads = oracle(args, cotangents, negative)
    if negative:  # the inputs reach both signs of the decay
        a = 2 * np.exp(args[1] * -np.exp(args[2])) - 1
        assert (a < 0).mean() > 0.2 and (a > 0).mean() > 0.2
    for form, chunk in (("recurrent", 64), ("chunkwise", 16), ("chunkwise", 64), ("quadratic", 64)):
        what = f"{form} C={chunk}"
        y, h, grads = ours(
            args, cotangents, form=form, chunk_size=chunk, negative_eigenvalues=negative
        )
        assert y.dtype == jnp.float32 and h.dtype == jnp.float32
        assert rel_err(y, want_y) <= RTOL, what
        assert rel_err(h, want_h) <= RTOL, what
        for name, got, want in zip(ARG_NAMES, grads, want_grads, strict=True):
            assert rel_err(got, want) <= GRAD_RTOL, f"{what}: d{name}"


def test_many_negative_decays_stay_finite():
    """4096 tokens of decays near -1 (and exactly -1): no overflow, no NaN, the oracle's
    values; the chunk's signed product carries the sign across 64 chunks."""
    T = 4096
    rng = np.random.default_rng(2)
    b, n, h = 1, 2, 4
    q = rng.standard_normal((b, T, n, h)).astype(np.float32)
    k = rng.standard_normal((b, T, n, h)).astype(np.float32) * 0.1
    v = rng.standard_normal((b, T, n, 3)).astype(np.float32)
    log_g = np.zeros((b, T, n), np.float32)
    log_g[..., 1] = np.log(rng.uniform(0.99, 1.0, (b, T)))  # head 1: |a| in [0.99, 1]
    neg = rng.uniform(size=(b, T, n)) < 0.9
    neg[..., 0] = True  # head 0: a = -1 at every token
    a = np.where(neg, -1.0, 1.0) * np.exp(log_g.astype(np.float64))
    S = np.zeros((b, n, h, 3))
    want = np.zeros((b, T, n, 3))
    for t in range(T):
        S = a[:, t, :, None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        want[:, t] = np.einsum("bnh,bnhe->bne", q[:, t], S)

    def run(q, k, v, form):
        out = linear_attention(
            q,
            k,
            v,
            form=form,
            feature_map="identity",
            normalize=False,
            log_gates=log_g,
            negative_gates=neg,
            chunk_size=64,
        )
        return jnp.sum(out[:, -64:] ** 2), out

    for form in ("chunkwise", "recurrent"):
        grads, out = jax.jit(jax.grad(partial(run, form=form), argnums=(0, 1, 2), has_aux=True))(
            q, k, v
        )
        assert rel_err(out, want) <= 1e-4, form  # 4096 steps of float32 roundoff
        assert all(np.isfinite(g).all() for g in grads), form
    # The decay itself: 2 exp(dt A) - 1 at and around 0 and -1, finite gradients.
    dt = jnp.asarray([0.0, 1e-3, np.log(2.0), np.log(2.0) + 1e-4, 5.0, 80.0])
    log_a, neg_a = ssd_decay(dt, -jnp.ones(6), True)
    grad = jax.grad(lambda d: jnp.sum(ssd_decay(d, -jnp.ones(6), True)[0]))(dt)
    want_a = 2 * np.exp(-np.asarray(dt, np.float64)) - 1
    got_a = np.where(np.asarray(neg_a), -1, 1) * np.exp(np.asarray(log_a, np.float64))
    np.testing.assert_allclose(got_a, want_a, atol=1e-6)
    assert np.isfinite(grad).all()


def test_step_and_single_tokens():
    """``ssd_step`` iterated over T tokens, and T = 1 in every form, equal the oracle."""
    T = 5
    x, dt, A_log, Bm, Cm, D, h0 = make_inputs(3, T)
    A = -np.exp(A_log)
    for negative in (False, True):
        want_y, want_h = np_oracle(x, dt, A_log, Bm, Cm, D, h0, negative=negative)
        step = jax.jit(partial(ssd_step, negative_eigenvalues=negative))
        h = jnp.asarray(h0)
        for t in range(T):
            y_t, h = step(h, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D=D)
            assert rel_err(y_t, want_y[:, t]) <= RTOL, (negative, t)
        assert rel_err(h, want_h) <= RTOL
        first = np_oracle(
            x[:, :1], dt[:, :1], A_log, Bm[:, :1], Cm[:, :1], D, h0, negative=negative
        )
        for form in SSD_FORMS:
            y, h1 = ssd(
                x[:, :1],
                dt[:, :1],
                A,
                Bm[:, :1],
                Cm[:, :1],
                D=D,
                initial_state=h0,
                return_state=True,
                form=form,
                negative_eigenvalues=negative,
            )
            assert rel_err(y, first[0]) <= RTOL and rel_err(h1, first[1]) <= RTOL, form


IDS = np.array(
    [
        [1] * 9 + [2] * 4 + [3] * 5 + [0] * 2,
        [5] * 3 + [0] + [6] * 10 + [0] + [7] * 4 + [0],
    ],
    np.int32,
)


def test_packed_equals_each_segment_alone():
    """Negative eigenvalues, chunks of 8: a packed, padded batch is each segment alone;
    padding (holding NaN) outputs 0 and reaches nothing."""
    T = IDS.shape[1]
    x, dt, A_log, Bm, Cm, D, _ = make_inputs(4, T)
    A = -np.exp(A_log)
    x = np.where((IDS == 0)[..., None, None], np.nan, x)
    with jax.enable_x64(True):
        A64, D64 = -jnp.exp(jnp.asarray(A_log, jnp.float64)), jnp.asarray(D, jnp.float64)

        def alone(x, dt, Bm, Cm):
            return reference.ssd(x, dt, A64, Bm, Cm, D64, negative_eigenvalues=True)

        args64 = [np.asarray(a, np.float64) for a in (x, dt, Bm, Cm)]
        want, _ = reference.each_segment(alone, IDS, *args64)
    for form in SSD_FORMS:
        run = jax.jit(partial(ssd, form=form, chunk_size=8, negative_eigenvalues=True))
        out = run(x, dt, A, Bm, Cm, D=D, segment_ids=IDS)
        np.testing.assert_array_equal(np.asarray(out)[IDS == 0], 0.0)
        for b in range(Bt):
            for seg in set(IDS[b]) - {0}:
                at = np.flatnonzero(IDS[b] == seg)
                assert rel_err(out[b : b + 1, at], want[b : b + 1, at]) <= RTOL, (form, b, seg)


def test_zero_state_and_bad_input():
    assert init_ssd_state(2, N, H, E).shape == (2, N, H, E)
    x, dt, A_log, Bm, Cm, D, h0 = make_inputs(5, 4)
    good = dict(x=x, dt=dt, A=-np.exp(A_log), B=Bm, C=Cm)
    cases = [
        (dict(x=x[0]), "x"),
        (dict(B=Bm[:, :, :1].repeat(3, 2)), "B"),  # 3 groups do not divide 4 heads
        (dict(C=Cm[:, :2]), "C"),
        (dict(dt=dt[..., :1]), "dt"),
        (dict(dt=-dt), "dt"),
        (dict(A=np.exp(A_log)), "A"),
        (dict(A=np.full_like(A_log, -np.inf)), "A"),  # dt = 0 would make dt * A NaN
        (dict(dt=np.full_like(dt, np.inf)), "dt"),  # inf * (A = 0) is NaN, inf * x inf
        (dict(dt=np.full_like(dt, np.nan)), "dt"),
        (dict(A=A_log[:2]), "A"),
        (dict(D=D[:1]), "D"),
        (dict(form="parallel"), "form"),
        (dict(initial_state=h0[:, :1]), "initial_state"),
        (dict(segment_ids=np.ones((2, 3), np.int32)), "segment_ids"),
    ]
    for change, arg in cases:
        with pytest.raises(ValueError, match=f"^{arg}: expected"):
            ssd(**{**good, **change})
    with pytest.raises(ValueError, match=r"^state: expected"):
        ssd_step(h0[:, :1], x[:, 0], dt[:, 0], good["A"], Bm[:, 0], Cm[:, 0])
    q = np.ones((2, 4, 2, 3), np.float32)
    for change, arg in (
        (dict(negative_gates=np.ones((2, 4, 2), np.float32)), "negative_gates"),
        (dict(negative_gates=np.ones((2, 4, 1), bool)), "negative_gates"),
        (dict(negative_gates=np.ones((2, 4, 2), bool), causal=False), "negative_gates"),
    ):
        with pytest.raises(ValueError, match=f"^{arg}: expected"):
            linear_attention(q, q, q, **change)


def test_step_gradients_equal_the_sequence_gradients():
    """Gradients through 5 iterated ``ssd_step`` calls (negative eigenvalues) equal those of
    ``ssd`` over the 5 tokens, for every argument."""
    args = make_inputs(6, 5)
    rng = np.random.default_rng(7)
    cotangents = tuple(
        rng.standard_normal(s).astype(np.float32) for s in ((Bt, 5, N, E), (Bt, N, H, E))
    )

    def stepped(x, dt, A_log, Bm, Cm, D, h):
        A, ys = -jnp.exp(A_log), []
        for t in range(x.shape[1]):
            y, h = ssd_step(
                h, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D=D, negative_eigenvalues=True
            )
            ys.append(y)
        return jnp.stack(ys, axis=1), h

    loss = _loss(stepped, cotangents)
    grads, (y, h) = jax.jit(jax.grad(loss, argnums=range(7), has_aux=True))(*args)
    want_y, want_h, want_grads = ours(args, cotangents, form="chunkwise", negative_eigenvalues=True)
    assert rel_err(y, want_y) <= RTOL and rel_err(h, want_h) <= RTOL
    for name, got, want in zip(ARG_NAMES, grads, want_grads, strict=True):
        assert rel_err(got, want) <= GRAD_RTOL, name
