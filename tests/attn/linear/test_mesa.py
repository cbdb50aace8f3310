"""MesaNet (``attn.mesa_net``) against the library's float64 reference.

``attn.linear.reference.mesa_net`` updates both sums a token at a time and solves
exactly (``jnp.linalg``'s solve) or by the authors' conjugate gradients (their backward: the same
steps on the cotangent). Both forms, with the exact solve and with CG at a few steps,
are checked on outputs, final states and every gradient, from an initial state, at T
a multiple of no chunk; CG nears the exact solve with its steps; a split and each token
continue the sequence; packed segments equal each alone; bad input is named.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.linear import reference
from tests.util import rel_err

RTOL, GRAD_RTOL = 1e-5, 1e-4
B, T, N, H, E, C = 2, 21, 2, 8, 6, 8


def make_inputs(seed):
    """q, k unit; beta, gamma and lambda in the layer's ranges; a state with a PSD G."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    q, k, v = unit(f32(B, T, N, H)), unit(f32(B, T, N, H)), f32(B, T, N, E)
    beta = sigmoid(f32(B, T, N))
    log_gates = np.log(rng.uniform(0.7, 1.0, (B, T, N))).astype(np.float32)
    lam = (0.25 + 0.75 * sigmoid(f32(N, H))).astype(np.float32)
    keys = unit(f32(B, N, 3, H))
    G0 = np.einsum("bnsh,bnsj->bnhj", keys, keys).astype(np.float32)
    return [q, k, v, beta, log_gates, lam, 0.3 * f32(B, N, H, E), G0]


def float64(args, cotangents, cg_steps):
    with jax.enable_x64(True):
        x64 = [jnp.asarray(a, jnp.float64) for a in args]

        def loss(q, k, v, beta, log_gates, lam, S0, G0):
            out, (S, G) = reference.mesa_net(q, k, v, beta, log_gates, lam, cg_steps=cg_steps,
                                             initial_state=(S0, G0))  # fmt: skip
            return jnp.sum(out * cotangents[0]) + jnp.sum(S * cotangents[1]), (out, S, G)

        grads, aux = jax.jit(jax.grad(loss, argnums=range(8), has_aux=True))(*x64)
        return [np.asarray(x) for x in aux], grads


def ours(args, cotangents, cg_steps, form):
    def loss(q, k, v, beta, log_gates, lam, S0, G0):
        out, state = attn.mesa_net(q, k, v, beta, lam, log_gates=log_gates, cg_steps=cg_steps,
                                   form=form, chunk_size=C, return_state=True,
                                   initial_state=attn.MesaState(S0, G0))  # fmt: skip
        return jnp.sum(out * cotangents[0]) + jnp.sum(state.S * cotangents[1]), (
            out, state.S, state.G)  # fmt: skip

    return jax.jit(jax.grad(loss, argnums=range(8), has_aux=True))(*args)


@functools.cache
def case(cg_steps):
    """The inputs, cotangents and float64 results (one per solve, shared by the forms)."""
    args = make_inputs(0)
    rng = np.random.default_rng(1)
    cotangents = [rng.standard_normal(s) for s in ((B, T, N, E), (B, N, H, E))]
    return args, cotangents, float64(args, cotangents, cg_steps)


@pytest.mark.parametrize("cg_steps", [None, 3], ids=["exact", "cg3"])
@pytest.mark.parametrize("form", attn.MESA_FORMS)
def test_forms_match_float64_forward_and_gradients(form, cg_steps):
    args, cotangents, (want, want_grads) = case(cg_steps)
    grads, got = ours(args, cotangents, cg_steps, form)
    for name, g, w in zip(("out", "S", "G"), got, want, strict=True):
        assert g.dtype == jnp.float32 and rel_err(g, w) <= RTOL, (name, rel_err(g, w))
    names = ("q", "k", "v", "beta", "log_gates", "lam", "S0", "G0")
    for name, g, w in zip(names, grads, want_grads, strict=True):
        assert rel_err(g, np.asarray(w)) <= GRAD_RTOL, (name, rel_err(g, np.asarray(w)))


def test_cg_nears_the_exact_solve_with_its_steps_and_each_token_continues_the_sequence():
    q, k, v, beta, log_gates, lam, S0, G0 = make_inputs(2)
    state = attn.MesaState(S0, G0)
    kw = dict(log_gates=log_gates, chunk_size=C, initial_state=state, return_state=True)
    exact, end = attn.mesa_net(q, k, v, beta, lam, **kw)
    # CG nears the exact solve as its steps grow, down to where the authors' 1e-5 in its
    # denominators stalls it (about 4e-4 here at 30 steps, in float64 as in float32).
    errors = [rel_err(attn.mesa_net(q, k, v, beta, lam, cg_steps=n, **kw)[0], exact)
              for n in (2, H, 30)]  # fmt: skip
    assert errors[0] > 1e-2 and errors[0] > errors[1] > errors[2] and errors[2] < 1e-3
    first, mid = attn.mesa_net(*(x[:, :13] for x in (q, k, v, beta)), lam, **kw | dict(
        log_gates=log_gates[:, :13]))  # fmt: skip
    rest, last = attn.mesa_net(*(x[:, 13:] for x in (q, k, v, beta)), lam, **kw | dict(
        log_gates=log_gates[:, 13:], initial_state=mid, form="recurrent"))  # fmt: skip
    assert rel_err(jnp.concatenate([first, rest], 1), exact) <= RTOL
    step = jax.jit(attn.mesa_net_step)
    outs = []
    for t in range(T):
        out, state = step(q[:, t], k[:, t], v[:, t], beta[:, t], lam, state,
                          log_gates=log_gates[:, t])  # fmt: skip
        outs.append(out)
    assert rel_err(jnp.stack(outs, 1), exact) <= RTOL
    for a, b, c in zip(end, last, state, strict=True):
        assert rel_err(b, a) <= RTOL and rel_err(c, a) <= RTOL


def test_packed_segments_equal_each_alone_and_padding_is_nowhere():
    q, k, v, beta, log_gates, lam, S0, G0 = make_inputs(3)
    ids = np.asarray([[1] * 5 + [0] * 2 + [2] * 14, [3] * 10 + [4] * 9 + [0] * 2], np.int32)
    pad = ids == 0
    for x in (q, k, v, beta, log_gates):
        x[pad] = np.nan
    state = attn.MesaState(S0, G0)
    tokens = (q, k, v, beta, log_gates)
    alone, ends = {}, {}  # each segment alone (the recurrent form), its row's last state
    for row in range(B):
        for n, seg in enumerate(dict.fromkeys(ids[row][~pad[row]])):
            at = np.flatnonzero(ids[row] == seg)
            first = attn.MesaState(*(x[row : row + 1] for x in state)) if n == 0 else None
            q1, k1, v1, b1, g1 = (x[row : row + 1, at] for x in tokens)
            alone[row, seg], ends[row] = attn.mesa_net(
                q1, k1, v1, b1, lam, log_gates=g1, form="recurrent", initial_state=first,
                return_state=True)  # fmt: skip
    for form in attn.MESA_FORMS:
        out, final = attn.mesa_net(q, k, v, beta, lam, log_gates=log_gates, form=form,
                                   chunk_size=C, initial_state=state, return_state=True,
                                   q_segment_ids=ids, kv_segment_ids=ids)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)
        for (row, seg), want in alone.items():
            assert rel_err(out[row, ids[row] == seg], want[0]) <= RTOL, (form, row, seg)
        for row, end in ends.items():
            for got, want in zip(final, end, strict=True):
                np.testing.assert_allclose(got[row], want[0], rtol=RTOL, atol=1e-6)

    def loss(*tokens):
        q, k, v, beta, log_gates = tokens
        out = attn.mesa_net(q, k, v, beta, lam, log_gates=log_gates, chunk_size=C,
                            q_segment_ids=ids, kv_segment_ids=ids)  # fmt: skip
        return jnp.sum(out)

    for g in jax.grad(loss, argnums=range(5))(*tokens):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_array_equal(np.asarray(g)[pad], 0.0)


def test_bad_input_is_named():
    q, k, v, beta, log_gates, lam, S0, G0 = (jnp.asarray(x) for x in make_inputs(4))
    cases = [
        (dict(v=v[:, :, :1]), r"^v: expected shape \(2, 21, N, E\) with N a multiple"),
        (dict(beta=beta[..., :1]), r"^beta: expected shape \(2, 21, 2\)"),
        (dict(lam=lam[:, :3]), r"^lam: expected shape \(2, 8\) = \[N,H\]"),
        (dict(lam=-lam), r"^lam: expected values > 0"),
        (dict(log_gates=-log_gates), r"^log_gates: expected values <= 0"),
        (dict(cg_steps=0), r"^cg_steps: expected a positive int"),
        (dict(form="parallel"), r"^form: expected one of \('recurrent', 'chunkwise'\)"),
        (dict(initial_state=(S0, G0)), r"^initial_state: expected a MesaState"),
        (dict(initial_state=attn.MesaState(S0, G0[..., :3])), r"^initial_state.G: expected"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, beta=beta, lam=lam, log_gates=log_gates) | change
        with pytest.raises(ValueError, match=message):
            attn.mesa_net(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("beta"),
                          args.pop("lam"), **args)  # fmt: skip
    # The sharded form checks the call as the one-device form does, before any mesh runs.
    mesh = jax.make_mesh((1,), ("seq",))
    for lam_bad, message in ((-lam, r"^lam: expected values > 0"), (lam[:1], r"^lam: expected")):
        with pytest.raises(ValueError, match=message):
            attn.sharded_mesa_net(q, k, v, beta, lam_bad, axis_name="seq", mesh=mesh)
    with pytest.raises(ValueError, match=r"^initial_state: expected a MesaState"):
        attn.mesa_net_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam, (S0, G0))
