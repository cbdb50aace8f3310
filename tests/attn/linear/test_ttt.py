"""TTT-Linear (``attn.linear.ttt``) against the library's float64 reference from the paper.

``attn.linear.reference.ttt_linear`` trains the inner model a token at a time with
its LayerNorm's gradient in closed form; the dual, primal and recurrent forms are
checked on outputs, final states and every gradient (q, k, v, the rates, the
LayerNorm, the per-position rates and the initial model), at T a multiple of no
mini-batch, with rows whose initial states are at different points of a
mini-batch. A sequence split inside a mini-batch, and token by token, continues
exactly; bad input is named.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.linear import reference
from attn.linear.ttt import TTTState, ttt_linear, ttt_linear_step, ttt_zero_state
from tests.util import rel_err

RTOL, GRAD_RTOL = 1e-5, 1e-4
B, T, N, H, MB = 2, 21, 2, 8, 8
COUNTS = np.array([0, 5])  # row 1 starts 5 tokens into a mini-batch


def make_inputs(seed):
    """q, k, v, eta (the layer's scale: sigmoid / H), the LayerNorm, per-position rates
    near 1 / (i + 1), and an initial state: a model and, for row 1, a mini-batch's sums."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    eta = (1 / (1 + np.exp(-f32(B, T, N))) / H).astype(np.float32)
    lr = (1 / np.arange(1, MB + 1) + 0.05 * f32(MB)).astype(np.float32)
    W, b = 0.1 * f32(B, N, H, H), 0.1 * f32(B, N, H)
    dW, db = 0.05 * f32(B, N, H, H), 0.05 * f32(B, N, H)
    dW[0], db[0] = 0.0, 0.0  # row 0 at a boundary
    return [f32(B, T, N, H), f32(B, T, N, H), f32(B, T, N, H), eta, 1 + 0.1 * f32(N, H),
            0.1 * f32(N, H), lr, W, b, dW, db]  # fmt: skip


def float64(args, cotangents):
    """The reference's outputs, final state and gradients of ``<out, do> + <W, dW>``."""
    with jax.enable_x64(True):
        x64 = [jnp.asarray(a, jnp.float64) for a in args]
        c64 = [jnp.asarray(c, jnp.float64) for c in cotangents]

        def loss(q, k, v, eta, scale, bias, lr, W, b, dW, db):
            out, state = reference.ttt_linear(q, k, v, eta, scale, bias, lr, mini_batch=MB,
                                              initial_state=(W, b, dW, db, COUNTS))  # fmt: skip
            return jnp.sum(out * c64[0]) + jnp.sum(state[0] * c64[1]), (out, state)

        grads, (out, state) = jax.jit(jax.grad(loss, argnums=range(11), has_aux=True))(*x64)
        return np.asarray(out), state, [np.asarray(g) for g in grads]


def ours(args, cotangents, form):
    def loss(q, k, v, eta, scale, bias, lr, W, b, dW, db):
        state = TTTState(W, b, dW, db, jnp.asarray(COUNTS, jnp.int32))
        out, final = ttt_linear(q, k, v, eta, norm_scale=scale, norm_bias=bias, position_lr=lr,
                                mini_batch=MB, form=form, initial_state=state,
                                return_state=True)  # fmt: skip
        return jnp.sum(out * cotangents[0]) + jnp.sum(final.W * cotangents[1]), (out, final)

    grads, (out, final) = jax.jit(jax.grad(loss, argnums=range(11), has_aux=True))(*args)
    return out, final, grads


@pytest.mark.parametrize("form", ["dual", "primal", "recurrent"])
def test_forms_match_float64_forward_and_gradients(form):
    args = make_inputs(0)
    rng = np.random.default_rng(1)
    cotangents = [rng.standard_normal(s).astype(np.float32) for s in ((B, T, N, H), (B, N, H, H))]
    want_out, want_state, want_grads = float64(args, cotangents)
    out, final, grads = ours(args, cotangents, form)
    assert out.dtype == jnp.float32 and rel_err(out, want_out) <= RTOL
    for got, want in zip(final[:4], want_state[:4], strict=True):
        assert rel_err(got, np.asarray(want)) <= RTOL
    np.testing.assert_array_equal(final.count, (COUNTS + T) % MB)
    names = ("q", "k", "v", "eta", "norm_scale", "norm_bias", "position_lr", "W", "b", "dW", "db")
    for name, got, want in zip(names, grads, want_grads, strict=True):
        assert rel_err(got, want) <= GRAD_RTOL, (name, rel_err(got, want))


def test_a_split_inside_a_mini_batch_and_each_token_continue_the_sequence():
    q, k, v, eta, scale, bias = make_inputs(2)[:6]
    kw = dict(norm_scale=scale, norm_bias=bias, mini_batch=MB)
    whole, final = ttt_linear(q, k, v, eta, return_state=True, **kw)
    first, mid = ttt_linear(q[:, :13], k[:, :13], v[:, :13], eta[:, :13], return_state=True, **kw)
    assert (np.asarray(mid.count) == 13 % MB).all()
    rest, end = ttt_linear(q[:, 13:], k[:, 13:], v[:, 13:], eta[:, 13:], initial_state=mid,
                           return_state=True, form="primal", **kw)  # fmt: skip
    assert rel_err(jnp.concatenate([first, rest], 1), whole) <= RTOL
    state, steps = ttt_zero_state(B, N, H), []
    step = jax.jit(functools.partial(ttt_linear_step, **kw))
    for t in range(T):
        out, state = step(q[:, t], k[:, t], v[:, t], eta[:, t], state)
        steps.append(out)
    assert rel_err(jnp.stack(steps, 1), whole) <= RTOL
    for a, b, c in zip(final, end, state, strict=True):
        assert rel_err(b, a) <= RTOL and rel_err(c, a) <= RTOL


def test_bad_input_is_named():
    q, k, v, eta, scale, bias = (jnp.asarray(x) for x in make_inputs(3)[:6])
    kw = dict(norm_scale=scale, norm_bias=bias)
    cases = [
        (dict(v=v[..., :4]), r"^q, k, v: expected one shape"),
        (dict(eta=eta[:, :, :1]), r"^eta: expected shape \(2, 21, 2\)"),
        (dict(norm_scale=scale[:1]), r"^norm_scale: expected shape \(2, 8\) = \[N,H\]"),
        (dict(form="chunkwise"), r"^form: expected one of \('dual', 'primal', 'recurrent'\)"),
        (dict(mini_batch=0), r"^mini_batch: expected a positive int"),
        (dict(position_lr=np.ones(3)), r"^position_lr: expected shape \(16,\) = \[mini_batch\]"),
        (dict(initial_state=np.zeros(3)), r"^initial_state: expected a TTTState"),
        (dict(initial_state=ttt_zero_state(1, N, H)), r"^initial_state.W: expected shape"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, eta=eta, **kw) | change
        with pytest.raises(ValueError, match=message):
            ttt_linear(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("eta"), **args)
