"""The memories trained on the sequence, TTT-Linear, TTT-MLP (``attn.linear.ttt``) and Titans
(``attn.titans``, a linear and an MLP memory), against the library's float64 references.

``attn.linear.reference.ttt`` and ``.titans`` train the inner model a token at a
time, every gradient in closed form (the LayerNorm's, the GELU's); the dual, primal
and recurrent forms are checked on outputs, final states and every gradient (q, k,
v, the gates, the LayerNorm, TTT's per-position rates and the initial state's
trees), at T a multiple of no mini-batch, with rows whose initial states are at
different points of a mini-batch. A sequence split inside a mini-batch, and token
by token, continues exactly; packed segments equal each alone, padding reaches
nothing; bad input is named.
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
MODELS = ["ttt-linear", "ttt-mlp", "titans-linear", "titans-mlp"]
TREES = {"ttt": ("params", "sums"), "titans": ("params", "momentum", "start")}


def shapes(model):
    return [(B, N, H, H), (B, N, H)] if model.endswith("linear") else [
        (B, N, H, F), (B, N, F), (B, N, F, H), (B, N, H)]  # fmt: skip


def make_inputs(seed, model):
    """``[q, k, v, *gates, norm_scale, norm_bias, *hyper, *trees]``: the gates as the layers
    make them (TTT's eta = sigmoid / H; Titans' step, momentum and decay), the LayerNorm,
    TTT's per-position rates near 1 / (i + 1), an initial model and, for row 1, a
    mini-batch's progress (TTT's sums; Titans' momentum and other start weights)."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    sigmoid = (1 / (1 + np.exp(-f32(B, T, N))) / H).astype(np.float32)
    params = [0.3 * f32(*s) for s in shapes(model)]
    partial = [0.05 * f32(*s) for s in shapes(model)]  # TTT's sums, Titans' momentum
    for x in partial:
        x[0] = 0.0  # row 0 at a boundary, nothing of a mini-batch yet
    if model.startswith("ttt"):
        gates, hyper = [sigmoid], [(1 / np.arange(1, MB + 1) + 0.05 * f32(MB)).astype(np.float32)]
        progress = [partial]
    else:
        log_momentum = np.log(rng.uniform(0.5, 0.95, (B, T, N))).astype(np.float32)
        log_decay = np.log1p(-rng.uniform(0.0, 0.1, (B, T, N))).astype(np.float32)
        gates, hyper = [2 * sigmoid, log_momentum, log_decay], []
        start = [p + 0.05 * f32(*p.shape) for p in params]  # row 1's mini-batch began elsewhere
        for x, p in zip(start, params, strict=True):
            x[0] = p[0]
        progress = [partial, start]
    qkv = [f32(B, T, N, H) for _ in range(3)]
    return [*qkv, *gates, 1 + 0.1 * f32(N, H), 0.1 * f32(N, H), *hyper, params, *progress]


def split(model, args):
    """``(q, k, v, gates, scale, bias, hyper, trees)`` of ``make_inputs``' list."""
    n = 1 if model.startswith("ttt") else 3
    q, k, v, *rest = args
    gates, (scale, bias), rest = rest[:n], rest[n : n + 2], rest[n + 2 :]
    hyper = rest[:1] if model.startswith("ttt") else []
    return q, k, v, gates, scale, bias, hyper, rest[len(hyper) :]


def call(name, args, count, **kw):
    """The library's function on ``make_inputs``' list, from the state of its trees."""
    family, memory = name.split("-")
    q, k, v, gates, scale, bias, hyper, trees = split(name, args)
    norms = dict(norm_scale=scale, norm_bias=bias, mini_batch=MB)
    count = jnp.asarray(count, jnp.int32)
    if family == "ttt":
        fn = attn.ttt_linear if memory == "linear" else attn.ttt_mlp
        state = attn.TTTState(*map(tuple, trees), count)
        return fn(q, k, v, *gates, position_lr=hyper[0], initial_state=state, **norms, **kw)
    state = attn.TitansState(*map(tuple, trees), count)
    return attn.titans(q, k, v, *gates, memory=memory, initial_state=state, **norms, **kw)


def oracle(model, args):
    q, k, v, gates, scale, bias, hyper, trees = split(model, args)
    fn = reference.ttt if model.startswith("ttt") else reference.titans
    return fn(q, k, v, *gates, scale, bias, *hyper, (*trees, COUNTS), mini_batch=MB)


def float64(model, args, cotangents):
    """The reference's outputs, final state and gradients of ``<out, do> + <W, dW>``."""
    with jax.enable_x64(True):
        x64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), args)
        c64 = [jnp.asarray(c, jnp.float64) for c in cotangents]

        def loss(*args):
            out, state = oracle(model, args)
            return jnp.sum(out * c64[0]) + jnp.sum(state[0][0] * c64[1]), (out, state)

        grads, (out, state) = jax.jit(jax.grad(loss, argnums=range(len(x64)), has_aux=True))(*x64)
        return np.asarray(out), state, grads


def ours(model, args, cotangents, form):
    def loss(*args):
        out, final = call(model, args, COUNTS, form=form, return_state=True)
        return jnp.sum(out * cotangents[0]) + jnp.sum(final.params[0] * cotangents[1]), (
            out, final)  # fmt: skip

    grads, (out, final) = jax.jit(jax.grad(loss, argnums=range(len(args)), has_aux=True))(*args)
    return out, final, grads


@functools.cache
def case(model):
    """The inputs, cotangents and float64 results of ``model``'s case (one per model, shared
    by its forms)."""
    args = make_inputs(0, model)
    rng = np.random.default_rng(1)
    cotangents = [rng.standard_normal(s).astype(np.float32)
                  for s in ((B, T, N, H), shapes(model)[0])]  # fmt: skip
    return args, cotangents, float64(model, args, cotangents)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("form", ["dual", "primal", "recurrent"])
def test_forms_match_float64_forward_and_gradients(model, form):
    args, cotangents, (want_out, want_state, want_grads) = case(model)
    out, final, grads = ours(model, args, cotangents, form)
    assert out.dtype == jnp.float32 and rel_err(out, want_out) <= RTOL
    fields = TREES[model.split("-")[0]]
    for field, want in zip(fields, want_state, strict=False):
        for got, w in zip(getattr(final, field), want, strict=True):
            assert rel_err(got, np.asarray(w)) <= RTOL, field
    np.testing.assert_array_equal(final.count, (COUNTS + T) % MB)
    for i, (got, want) in enumerate(zip(grads, want_grads, strict=True)):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert rel_err(g, np.asarray(w)) <= GRAD_RTOL, (i, rel_err(g, np.asarray(w)))


def _zero_state(model):
    family, memory = model.split("-")
    if family == "ttt":
        return attn.ttt_zero_state(B, N, H, mlp=memory == "mlp")
    return attn.titans_zero_state(B, N, H, memory=memory)


def _step(model, tokens, state):
    q, k, v, gates, scale, bias, hyper, _ = split(model, tokens)
    kw = dict(norm_scale=scale, norm_bias=bias, mini_batch=MB)
    if model.startswith("ttt"):
        fn = attn.ttt_linear_step if model.endswith("linear") else attn.ttt_mlp_step
        return fn(q, k, v, *gates, state, position_lr=hyper[0], **kw)
    return attn.titans_step(q, k, v, *gates, state, **kw)


@pytest.mark.parametrize("model", MODELS)
def test_a_split_inside_a_mini_batch_and_each_token_continue_the_sequence(model):
    args = make_inputs(2, model)
    fresh = _zero_state(model)
    fields = TREES[model.split("-")[0]]
    n = len(args) - len(fields)  # the tokens' arrays and the shared ones, before the trees
    per_token = [i for i, x in enumerate(args[:n]) if np.ndim(x) >= 3]

    def run(lo, hi, state, form="dual"):
        cut = [x[:, lo:hi] if i in per_token else x for i, x in enumerate(args[:n])]
        return call(model, cut + [list(getattr(state, f)) for f in fields], state.count,
                    form=form, return_state=True)  # fmt: skip

    whole, final = run(0, T, fresh)
    first, mid = run(0, 13, fresh)
    assert (np.asarray(mid.count) == 13 % MB).all()
    rest, end = run(13, T, mid, form="primal")
    assert rel_err(jnp.concatenate([first, rest], 1), whole) <= RTOL
    one = jax.jit(functools.partial(_step, model))
    state, outs = fresh, []
    for t in range(T):
        token = [x[:, t] if i in per_token else x for i, x in enumerate(args[:n])]
        out, state = one(token + [None] * (len(args) - n), state)
        outs.append(out)
    assert rel_err(jnp.stack(outs, 1), whole) <= RTOL
    for a, b, c in zip(jax.tree.leaves(final), jax.tree.leaves(end), jax.tree.leaves(state),
                       strict=True):  # fmt: skip
        assert rel_err(b, a) <= RTOL and rel_err(c, a) <= RTOL


def test_bad_input_is_named():
    q, k, v, eta, scale, bias = (jnp.asarray(x) for x in make_inputs(3, "ttt-linear")[:6])
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
        (dict(model=(np.zeros((N, H, H)),)), r"^model: expected 2 arrays \(W, b\)"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, eta=eta, **kw) | change
        with pytest.raises(ValueError, match=message):
            attn.ttt_linear(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("eta"), **args)
    theta, log_m, log_d = (jnp.asarray(x) for x in make_inputs(3, "titans-mlp")[3:6])
    gates = dict(theta=theta, log_momentum=log_m, log_decay=log_d)
    titans_cases = [
        (dict(theta=-theta), r"^theta: expected values >= 0"),
        (dict(log_decay=-log_d), r"^log_decay: expected values <= 0"),
        (dict(memory="deep"), r"^memory: expected one of \('linear', 'mlp'\)"),
        (dict(initial_state=mlp_state), r"^initial_state: expected a TitansState"),
        (dict(memory="mlp", initial_state=attn.titans_zero_state(B, N, H)),
         r"^initial_state.params: expected an MLP's 4 arrays"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"^state: expected a TitansState"):
        attn.titans_step(q[:, 0], k[:, 0], v[:, 0], theta[:, 0], log_m[:, 0], log_d[:, 0],
                         mlp_state)  # fmt: skip
    for change, message in titans_cases:
        args = gates | change
        with pytest.raises(ValueError, match=message):
            attn.titans(q, k, v, args.pop("theta"), args.pop("log_momentum"),
                        args.pop("log_decay"), **args)  # fmt: skip


# Packing and padding: a segment is a sequence of its own, restarting from the model with
# its own mini-batch grid; the first continues the initial state; padding is nowhere.
PACKED = {
    "fits": [[1] * 5 + [0] * 2 + [2] * 14, [3] * 10 + [4] * 9 + [0] * 2],
    # Eight short segments need more blocks than the grid has: the rows run token by token.
    "short": [[1, 1, 2, 2, 3, 0, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 8, 8, 8, 8], [1] * 21],
}


# Both rules and both models on the grid; the fallback (the forms' own, not a rule's) once.
@pytest.mark.parametrize(("model", "layout"), [("ttt-linear", "fits"), ("ttt-linear", "short"),
                                               ("titans-mlp", "fits")])  # fmt: skip
def test_packed_segments_equal_each_alone_and_padding_is_nowhere(model, layout):
    args = make_inputs(4, model)
    q, k, v, gates, scale, bias, hyper, trees = split(model, args)
    ids = np.asarray(PACKED[layout], np.int32)
    pad = ids == 0
    for x in (q, k, v, *gates):
        x[pad] = np.nan  # padding holds anything
    fields = TREES[model.split("-")[0]]
    inner = tuple(p[0] for p in trees[0])  # the model segments restart from, per head
    tokens = [q, k, v, *gates]
    alone, ends = {}, {}  # each segment alone (the recurrent form), its row's last state
    for row in range(B):
        for n, seg in enumerate(dict.fromkeys(ids[row][~pad[row]])):
            at = np.flatnonzero(ids[row] == seg)
            if n == 0:
                state = [[x[row : row + 1] for x in t] for t in trees]
                count = COUNTS[row : row + 1]
            else:
                state = [[np.broadcast_to(m, (1, *m.shape)) for m in inner]] * len(fields)
                state[1] = [np.zeros_like(x) for x in state[1]]
                count = np.zeros(1, np.int32)
            cut = [x[row : row + 1, at] for x in tokens]
            alone[row, seg], ends[row] = call(
                model,
                [*cut, scale, bias, *hyper, *state],
                count,
                form="recurrent",
                model=inner,
                return_state=True,
            )
    for form in ("dual", "primal", "recurrent"):
        out, final = call(model, args, COUNTS, form=form, model=inner, return_state=True,
                          q_segment_ids=ids, kv_segment_ids=ids)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)
        for (row, seg), want in alone.items():
            assert rel_err(out[row, ids[row] == seg], want[0]) <= RTOL, (form, row, seg)
        for row, end in ends.items():
            for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(end), strict=True):
                np.testing.assert_allclose(got[row], want[0], rtol=RTOL, atol=1e-6)

    def loss(*tokens):
        out = call(model, [*tokens, scale, bias, *hyper, *trees], COUNTS, model=inner,
                   q_segment_ids=ids, kv_segment_ids=ids)  # fmt: skip
        return jnp.sum(out * (1.0 + jnp.arange(H)))

    grads = jax.grad(loss, argnums=range(len(tokens)))(*tokens)
    for g in grads:  # NaN in padding reaches no gradient, and padding has none
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_array_equal(np.asarray(g)[pad], 0.0)
