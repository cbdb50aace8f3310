"""TTT-Linear and TTT-MLP (``attn.linear.ttt``) against the library's float64 reference.

``attn.linear.reference.ttt`` trains the inner model a token at a time, every
gradient in closed form (the LayerNorm's, the GELU's); the dual, primal and
recurrent forms are checked on outputs, final states and every gradient (q, k,
v, the rates, the LayerNorm, the per-position rates and the initial model and
sums), at T a multiple of no mini-batch, with rows whose initial states are at
different points of a mini-batch. A sequence split inside a mini-batch, and token
by token, continues exactly; bad input is named.
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
B, T, N, H, F, MB = 2, 21, 2, 8, 16, 8
COUNTS = np.array([0, 5])  # row 1 starts 5 tokens into a mini-batch
FNS = {"linear": (attn.ttt_linear, attn.ttt_linear_step), "mlp": (attn.ttt_mlp, attn.ttt_mlp_step)}


def shapes(model):
    return [(B, N, H, H), (B, N, H)] if model == "linear" else [
        (B, N, H, F), (B, N, F), (B, N, F, H), (B, N, H)]  # fmt: skip


def make_inputs(seed, model):
    """q, k, v, eta (the layer's scale: sigmoid / H), the LayerNorm, per-position rates
    near 1 / (i + 1), and an initial model and, for row 1, a mini-batch's sums."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    eta = (1 / (1 + np.exp(-f32(B, T, N))) / H).astype(np.float32)
    lr = (1 / np.arange(1, MB + 1) + 0.05 * f32(MB)).astype(np.float32)
    params = [0.3 * f32(*s) for s in shapes(model)]
    sums = [0.05 * f32(*s) for s in shapes(model)]
    for x in sums:
        x[0] = 0.0  # row 0 at a boundary
    return [f32(B, T, N, H), f32(B, T, N, H), f32(B, T, N, H), eta, 1 + 0.1 * f32(N, H),
            0.1 * f32(N, H), lr, params, sums]  # fmt: skip


def float64(args, cotangents):
    """The reference's outputs, final state and gradients of ``<out, do> + <W, dW>``."""
    with jax.enable_x64(True):
        x64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), args)
        c64 = [jnp.asarray(c, jnp.float64) for c in cotangents]

        def loss(q, k, v, eta, scale, bias, lr, params, sums):
            out, state = reference.ttt(q, k, v, eta, scale, bias, lr,
                                       (params, sums, COUNTS), mini_batch=MB)  # fmt: skip
            return jnp.sum(out * c64[0]) + jnp.sum(state[0][0] * c64[1]), (out, state)

        grads, (out, state) = jax.jit(jax.grad(loss, argnums=range(9), has_aux=True))(*x64)
        return np.asarray(out), state, grads


def ours(model, args, cotangents, form):
    def loss(q, k, v, eta, scale, bias, lr, params, sums):
        state = attn.TTTState(tuple(params), tuple(sums), jnp.asarray(COUNTS, jnp.int32))
        out, final = FNS[model][0](q, k, v, eta, norm_scale=scale, norm_bias=bias,
                                   position_lr=lr, mini_batch=MB, form=form,
                                   initial_state=state, return_state=True)  # fmt: skip
        return jnp.sum(out * cotangents[0]) + jnp.sum(final.params[0] * cotangents[1]), (
            out, final)  # fmt: skip

    grads, (out, final) = jax.jit(jax.grad(loss, argnums=range(9), has_aux=True))(*args)
    return out, final, grads


@pytest.mark.parametrize("model", ["linear", "mlp"])
@pytest.mark.parametrize("form", ["dual", "primal", "recurrent"])
def test_forms_match_float64_forward_and_gradients(model, form):
    args = make_inputs(0, model)
    rng = np.random.default_rng(1)
    cotangents = [rng.standard_normal(s).astype(np.float32)
                  for s in ((B, T, N, H), shapes(model)[0])]  # fmt: skip
    want_out, want_state, want_grads = float64(args, cotangents)
    out, final, grads = ours(model, args, cotangents, form)
    assert out.dtype == jnp.float32 and rel_err(out, want_out) <= RTOL
    for got, want in zip([*final.params, *final.sums], [*want_state[0], *want_state[1]],
                         strict=True):  # fmt: skip
        assert rel_err(got, np.asarray(want)) <= RTOL
    np.testing.assert_array_equal(final.count, (COUNTS + T) % MB)
    names = ("q", "k", "v", "eta", "norm_scale", "norm_bias", "position_lr", "params", "sums")
    for name, got, want in zip(names, grads, want_grads, strict=True):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert rel_err(g, np.asarray(w)) <= GRAD_RTOL, (name, rel_err(g, np.asarray(w)))


@pytest.mark.parametrize("model", ["linear", "mlp"])
def test_a_split_inside_a_mini_batch_and_each_token_continue_the_sequence(model):
    q, k, v, eta, scale, bias = make_inputs(2, model)[:6]
    run, step = FNS[model]
    kw = dict(norm_scale=scale, norm_bias=bias, mini_batch=MB)
    whole, final = run(q, k, v, eta, return_state=True, **kw)
    first, mid = run(q[:, :13], k[:, :13], v[:, :13], eta[:, :13], return_state=True, **kw)
    assert (np.asarray(mid.count) == 13 % MB).all()
    rest, end = run(q[:, 13:], k[:, 13:], v[:, 13:], eta[:, 13:], initial_state=mid,
                    return_state=True, form="primal", **kw)  # fmt: skip
    assert rel_err(jnp.concatenate([first, rest], 1), whole) <= RTOL
    state, outs = attn.ttt_zero_state(B, N, H, mlp=model == "mlp"), []
    one = jax.jit(functools.partial(step, **kw))
    for t in range(T):
        out, state = one(q[:, t], k[:, t], v[:, t], eta[:, t], state)
        outs.append(out)
    assert rel_err(jnp.stack(outs, 1), whole) <= RTOL
    for a, b, c in zip(jax.tree.leaves(final), jax.tree.leaves(end), jax.tree.leaves(state),
                       strict=True):  # fmt: skip
        assert rel_err(b, a) <= RTOL and rel_err(c, a) <= RTOL


def test_bad_input_is_named():
    q, k, v, eta, scale, bias = (jnp.asarray(x) for x in make_inputs(3, "linear")[:6])
    kw = dict(norm_scale=scale, norm_bias=bias)
    mlp_state = attn.ttt_zero_state(B, N, H, mlp=True)
    cases = [
        (dict(v=v[..., :4]), r"^v: expected the shape of q and k \(2, 21, 2, 8\)"),
        (dict(k=k[:, :, :1]), r"^k: expected the shape of q"),
        (dict(eta=eta[:, :, :1]), r"^eta: expected shape \(2, 21, 2\) = \[B,T,N\]"),
        (dict(norm_scale=scale[:1]), r"^norm_scale: expected shape \(2, 8\) = \[N,H\]"),
        (dict(norm_bias=None), r"^norm_scale, norm_bias: expected both arrays or both None"),
        (dict(form="chunkwise"), r"^form: expected one of \('dual', 'primal', 'recurrent'\)"),
        (dict(mini_batch=0), r"^mini_batch: expected a positive int"),
        (dict(position_lr=np.ones(3)), r"^position_lr: expected shape \(16,\) = \[mini_batch\]"),
        (dict(initial_state=np.zeros(3)), r"^initial_state: expected a TTTState"),
        (dict(initial_state=attn.ttt_zero_state(1, N, H)), r"^initial_state.params\[0\]: expected"),
        (dict(initial_state=mlp_state), r"^initial_state.params: expected 2 arrays \(W, b\)"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, eta=eta, **kw) | change
        with pytest.raises(ValueError, match=message):
            attn.ttt_linear(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("eta"), **args)


# Packing and padding: a segment is a sequence of its own, restarting from the model with
# its own mini-batch grid; the first continues the initial state; padding is nowhere.
PACKED = {
    "fits": [[1] * 5 + [0] * 2 + [2] * 14, [3] * 10 + [4] * 9 + [0] * 2],
    # Eight short segments need more blocks than the grid has: the rows run token by token.
    "short": [[1, 1, 2, 2, 3, 0, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 8, 8, 8, 8], [1] * 21],
}


@pytest.mark.parametrize("model", ["linear", "mlp"])
@pytest.mark.parametrize("layout", sorted(PACKED))
def test_packed_segments_equal_each_alone_and_padding_is_nowhere(model, layout):
    q, k, v, eta, scale, bias, lr, params, sums = make_inputs(4, model)
    ids = np.asarray(PACKED[layout], np.int32)
    pad = ids == 0
    for x in (q, k, v):
        x[pad] = np.nan  # padding holds anything
    eta[pad] = np.nan
    inner = tuple(p[0] for p in params)  # the model segments restart from, per head
    state = attn.TTTState(tuple(params), tuple(sums), jnp.asarray(COUNTS, jnp.int32))
    run = FNS[model][0]
    kw = dict(norm_scale=scale, norm_bias=bias, position_lr=lr, mini_batch=MB, model=inner)
    for form in ("dual", "primal", "recurrent"):
        out, final = run(q, k, v, eta, form=form, initial_state=state, return_state=True,
                         q_segment_ids=ids, kv_segment_ids=ids, **kw)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)
        for row in range(B):
            real = np.flatnonzero(~pad[row])
            for n, seg in enumerate(dict.fromkeys(ids[row][real])):
                at = np.flatnonzero(ids[row] == seg)
                first = jax.tree.map(lambda x, r=row: x[r : r + 1], state)
                alone, end = run(*(x[row : row + 1, at] for x in (q, k, v, eta)), form=form,
                                 initial_state=first if n == 0 else None, return_state=True,
                                 **kw)  # fmt: skip
                assert rel_err(out[row, at], alone[0]) <= RTOL, (form, row, seg)
            for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(end), strict=True):
                np.testing.assert_allclose(got[row], want[0], rtol=RTOL, atol=1e-6)

    def loss(q, k, v, eta):
        out = run(q, k, v, eta, q_segment_ids=ids, kv_segment_ids=ids, **kw)
        return jnp.sum(out * (1.0 + jnp.arange(H)))

    grads = jax.grad(loss, argnums=range(4))(q, k, v, eta)
    for g in grads:  # NaN in padding reaches no gradient, and padding has none
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_array_equal(np.asarray(g)[pad], 0.0)
