"""DeltaProduct: n Householder steps per token, against a float64 loop from the paper.

The oracle applies, per token, the gate once and then the ``n`` generalized
Householder steps ``S <- (I - beta k k^T) S + beta k v^T`` before the read,
as Siems et al. write it (not through the interleaved sequence the
implementation uses); its ``lax.scan`` twin in float64 gives the gradients.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.linear import DELTA_FORMS, delta_product, delta_product_step, delta_rule, reference
from tests.util import rel_err

RTOL = 1e-5
GRAD_RTOL = 1e-4
B, K, G, H, E = 2, 2, 2, 6, 4
N = K * G
T = 13


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed, T, n):
    rng = np.random.default_rng(seed)
    q = unit(rng.standard_normal((B, T, K, H))).astype(np.float32)
    k = unit(rng.standard_normal((B, T, n, K, H))).astype(np.float32)
    v = rng.standard_normal((B, T, n, N, E)).astype(np.float32)
    beta = rng.uniform(0.05, 1.95, (B, T, n, N)).astype(np.float32)  # negative eigenvalues
    g = -rng.uniform(0.0, 0.4, (B, T, N)).astype(np.float32)
    if T > 2:
        g[:, 2, 0] = -np.inf  # the edge value: a gate of 0 forgets the state
    state = rng.standard_normal((B, N, H, E)).astype(np.float32)
    return q, k, v, beta, g, state


def np_product(q, k, v, beta, g, state, scale=H**-0.5):
    q, k, v, beta, g = (np.asarray(x, np.float64) for x in (q, k, v, beta, g))
    S = np.array(state, np.float64)
    n = k.shape[2]
    out = np.zeros((B, q.shape[1], N, E))
    eye = np.eye(H)
    for t in range(q.shape[1]):
        for h in range(N):
            S[:, h] *= np.exp(g[:, t, h])[:, None, None]
            for j in range(n):
                kj = k[:, t, j, h // G]  # [B,H]
                bj = beta[:, t, j, h, None, None]
                householder = eye - bj * kj[:, :, None] * kj[:, None, :]
                S[:, h] = householder @ S[:, h] + bj * kj[:, :, None] * v[:, t, j, h][:, None]
            out[:, t, h] = np.einsum("bh,bhe->be", q[:, t, h // G] * scale, S[:, h])
    return out, S


def jnp_product(q, k, v, beta, g, state, scale=H**-0.5):
    """The library's reference (``attn.linear.reference``), run in float64 for the gradients."""
    return reference.delta_rule(q, k, v, beta, g, initial_state=state, scale=scale)


def _loss(run, do, dS):
    def loss(*args):
        out, S = run(*args)
        return jnp.sum(out * do) + jnp.sum(S * dS), (out, S)

    return loss


@pytest.mark.parametrize("n", [2, 3])
def test_forms_match_float64_forward_and_gradients(n):
    args = make_inputs(n, T, n)
    rng = np.random.default_rng(0)
    do = rng.standard_normal((B, T, N, E)).astype(np.float32)
    dS = rng.standard_normal((B, N, H, E)).astype(np.float32)
    want_out, want_S = np_product(*args)
    with jax.enable_x64(True):
        x64 = [jnp.asarray(a, jnp.float64) for a in args]
        loss = _loss(jnp_product, jnp.asarray(do, jnp.float64), jnp.asarray(dS, jnp.float64))
        want_grads, (out64, S64) = jax.grad(loss, argnums=range(6), has_aux=True)(*x64)
    assert rel_err(out64, want_out) <= 1e-12 and rel_err(S64, want_S) <= 1e-12

    def run(q, k, v, beta, g, state, form, chunk):
        return delta_product(
            q, k, v, beta, log_gates=g, form=form, chunk_size=chunk,
            initial_state=state, return_state=True,
        )  # fmt: skip

    for form, chunk in (("recurrent", 64), ("chunkwise", 8)):
        loss = _loss(partial(run, form=form, chunk=chunk), do, dS)
        grads, (out, S) = jax.jit(jax.grad(loss, argnums=range(6), has_aux=True))(*args)
        assert rel_err(out, want_out) <= RTOL and rel_err(S, want_S) <= RTOL, form
        names = ("q", "k", "v", "beta", "g", "state")
        for name, got, want in zip(names, grads, want_grads, strict=True):
            assert rel_err(got, want) <= GRAD_RTOL, f"{form} n={n}: d{name}"


def test_one_step_is_the_delta_rule_and_the_step_iterates():
    q, k, v, beta, g, state = make_inputs(4, T, 1)
    kw = dict(log_gates=g, initial_state=state, return_state=True, chunk_size=8)
    got = delta_product(q, k, v, beta, **kw)
    want = delta_rule(q, k[:, :, 0], v[:, :, 0], beta[:, :, 0], **kw)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    q, k, v, beta, g, state = make_inputs(5, 4, 3)
    want_out, want_S = np_product(q, k, v, beta, g, state)
    S = jnp.asarray(state)
    step = jax.jit(delta_product_step)
    for t in range(4):
        out_t, S = step(q[:, t], k[:, t], v[:, t], beta[:, t], S, log_gates=g[:, t])
        assert rel_err(out_t, want_out[:, t]) <= RTOL, t
    assert rel_err(S, want_S) <= RTOL


def test_packed_equals_each_segment_alone():
    ids = np.array([[1] * 6 + [2] * 5 + [0] * 2, [3] * 4 + [0] + [4] * 8], np.int32)
    q, k, v, beta, g, _ = make_inputs(6, T, 2)
    v = np.where((ids == 0)[:, :, None, None, None], np.nan, v)  # padding holds NaN
    zero = np.zeros((B, N, H, E), np.float32)
    want = {}
    for b in range(B):
        for seg in set(ids[b]) - {0}:
            at = np.flatnonzero(ids[b] == seg)
            rows = [x[:, at] for x in (q, k, v, beta, g)]  # the oracle runs both rows
            want[b, seg] = at, np_product(*rows, zero)[0][b]
    for form in DELTA_FORMS:
        run = jax.jit(partial(delta_product, form=form, chunk_size=4))
        out = run(q, k, v, beta, log_gates=g, q_segment_ids=ids, kv_segment_ids=ids)
        np.testing.assert_array_equal(np.asarray(out)[ids == 0], 0.0)
        for (b, seg), (at, alone) in want.items():
            assert rel_err(out[b, at], alone) <= RTOL, (form, b, seg)


def test_bad_input_names_the_argument():
    q, k, v, beta, g, _ = make_inputs(7, 4, 2)
    good = dict(q=q, k=k, v=v, beta=beta)
    for change, arg in (
        (dict(q=q[0]), "q"),
        (dict(k=k[:, :, 0]), "k"),
        (dict(k=k[:, :, :, :1]), "k"),
        (dict(v=v[:, :, :1]), "v"),
        (dict(beta=beta[:, :, :1]), "beta"),
        (dict(beta=np.full_like(beta, np.inf)), "beta"),
        (dict(log_gates=np.abs(g) + 1), "log_gates"),
    ):
        with pytest.raises(ValueError, match=f"^{arg}: expected"):
            delta_product(**{**good, **change})


def test_step_gradients_equal_the_sequence_gradients():
    """Gradients through 4 iterated ``delta_product_step`` calls (n = 2) equal the float64
    oracle's, for every argument."""
    args = make_inputs(8, 4, 2)
    rng = np.random.default_rng(9)
    do = rng.standard_normal((B, 4, N, E)).astype(np.float32)
    dS = rng.standard_normal((B, N, H, E)).astype(np.float32)

    def stepped(q, k, v, beta, g, S):
        outs = []
        for t in range(q.shape[1]):
            out, S = delta_product_step(q[:, t], k[:, t], v[:, t], beta[:, t], S, log_gates=g[:, t])
            outs.append(out)
        return jnp.stack(outs, axis=1), S

    grads, _ = jax.jit(jax.grad(_loss(stepped, do, dS), argnums=range(6), has_aux=True))(*args)
    with jax.enable_x64(True):
        x64 = [jnp.asarray(a, jnp.float64) for a in args]
        loss = _loss(jnp_product, jnp.asarray(do, jnp.float64), jnp.asarray(dS, jnp.float64))
        want, _ = jax.grad(loss, argnums=range(6), has_aux=True)(*x64)
    for name, got, w in zip(("q", "k", "v", "beta", "g", "state"), grads, want, strict=True):
        assert rel_err(got, w) <= GRAD_RTOL, name
