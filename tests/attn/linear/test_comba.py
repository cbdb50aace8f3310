"""Comba (``attn.comba``) against the library's float64 reference from the paper's equations.

``attn.linear.reference.comba`` is the recurrence as Comba writes it (the error
read with p before the decay, then the decayed write); ``attn.comba`` runs it
as the DPLR rule. Both forms are checked on outputs, final states and every
gradient, grouped value heads, T a multiple of no chunk, a gate of 0 inside;
packed segments with NaN padding equal each segment alone and decoding
continues them; bad input is named. The layer is ``tests/models``' (every kind).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.linear import reference
from tests.util import rel_err

RTOL, GRAD_RTOL = 1e-5, 1e-4
B, K, G, H, E = 2, 2, 2, 8, 8
N = K * G
T = 29  # a multiple of no chunk
NAMES = ("q", "k", "v", "p", "beta", "log_gates", "initial_state")


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed, length=T):
    """Unit q, k, p (p a scaled copy of k's direction plus noise), beta in (0, 1), log gates
    with a gate of 0 (log -inf) at token 9 of row 0, an initial state."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k = unit(f32(B, length, K, H)), unit(f32(B, length, K, H))
    p = unit(k + 0.3 * f32(B, length, K, H))
    beta = (1 / (1 + np.exp(-f32(B, length, N)))).astype(np.float32)
    log_g = -np.log1p(np.exp(f32(B, length, N))).astype(np.float32)
    if length > 9:
        log_g[0, 9, 1] = -np.inf
    return [q, k, f32(B, length, N, E), p, beta, log_g, 0.5 * f32(B, N, H, E)]


def float64(args, cotangents):
    """The reference's outputs, final state and gradients of ``<out, do> + <S, dS>``."""
    with jax.enable_x64(True):
        x64 = [jnp.asarray(a, jnp.float64) for a in args]
        c64 = [jnp.asarray(c, jnp.float64) for c in cotangents]

        def loss(q, k, v, p, beta, g, s0):
            out, S = reference.comba(q, k, v, p, beta, g, scale=H**-0.5, initial_state=s0)
            return jnp.sum(out * c64[0]) + jnp.sum(S * c64[1]), (out, S)

        grads, (out, S) = jax.jit(jax.grad(loss, argnums=range(7), has_aux=True))(*x64)
        return np.asarray(out), np.asarray(S), [np.asarray(g) for g in grads]


def ours(args, cotangents, **kw):
    def loss(q, k, v, p, beta, g, s0):
        out, S = attn.comba(q, k, v, p, beta, log_gates=g, initial_state=s0, return_state=True,
                            **kw)  # fmt: skip
        return jnp.sum(out * cotangents[0]) + jnp.sum(S * cotangents[1]), (out, S)

    grads, (out, S) = jax.jit(jax.grad(loss, argnums=range(7), has_aux=True))(*args)
    return out, S, grads


@pytest.mark.parametrize("form, chunk", [("recurrent", 64), ("chunkwise", 8)])
def test_forms_match_float64_forward_and_gradients(form, chunk):
    args = make_inputs(0)
    rng = np.random.default_rng(1)
    cotangents = (rng.standard_normal((B, T, N, E)), rng.standard_normal((B, N, H, E)))
    cotangents = tuple(c.astype(np.float32) for c in cotangents)
    want_out, want_S, want_grads = float64(args, cotangents)
    out, S, grads = ours(args, cotangents, form=form, chunk_size=chunk)
    assert out.dtype == jnp.float32 and S.dtype == jnp.float32
    assert rel_err(out, want_out) <= RTOL and rel_err(S, want_S) <= RTOL
    for name, got, want in zip(NAMES, grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(got)).all(), name
        assert rel_err(got, want) <= GRAD_RTOL, f"{form}: d{name}"


def test_packed_segments_are_each_alone_and_decoding_continues():
    """Two rows of packed segments with NaN padding; the last segment's state continues
    by ``comba_step`` as the reference continues it."""
    ids = np.array([[1] * 11 + [2] * 14 + [0] * 4, [0] * 3 + [5] * 20 + [0] + [6] * 5],
                   np.int32)  # fmt: skip
    extra = 3
    q, k, v, p, beta, log_g, _ = make_inputs(2, T + extra)
    pad = np.concatenate([ids == 0, np.zeros((B, extra), bool)], axis=1)
    nan = lambda x: np.where(pad.reshape(*pad.shape, *(1,) * (x.ndim - 2)), np.nan, x)  # noqa: E731
    args = [nan(x) for x in (q, k, v, p, beta, log_g)]
    every = np.concatenate([ids, np.repeat([[2], [6]], extra, axis=1)], axis=1)
    with jax.enable_x64(True):
        want, _ = reference.each_segment(reference.comba, every, *args, scale=H**-0.5)
    run = jax.jit(lambda *xs: attn.comba(*xs[:5], log_gates=xs[5], chunk_size=8,
                                         return_state=True, q_segment_ids=ids,
                                         kv_segment_ids=ids))  # fmt: skip
    out, state = run(*(x[:, :T] for x in args))
    np.testing.assert_array_equal(np.asarray(out)[ids == 0], 0.0)
    assert rel_err(out, want[:, :T]) <= RTOL
    step = jax.jit(attn.comba_step)
    for t in range(T, T + extra):
        x_t = [x[:, t] for x in args]
        out_t, state = step(*x_t[:5], state, log_gates=x_t[5])
        assert rel_err(out_t, want[:, t]) <= RTOL, t


def test_bad_input_is_named():
    q, k, v, p, beta, log_g, _ = make_inputs(3, 5)
    good = dict(q=q, k=k, v=v, p=p, beta=beta, log_gates=log_g)
    for change, arg in (
        (dict(p=p[..., :4]), "p"),
        (dict(beta=beta[..., :1]), "beta"),
        (dict(log_gates=np.abs(log_g) + 0.1), "log_gates"),
        (dict(v=v[:, :, :3]), "v"),
        (dict(form="quadratic"), "form"),
    ):
        with pytest.raises(ValueError, match=f"^{arg}: expected"):
            attn.comba(**{**good, **change})
