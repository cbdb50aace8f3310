"""Linear attention with segment ids: a packed, padded batch equals each segment run alone.

The oracle is ``linear_attention`` itself without segment ids (tested against
float64 NumPy in test_linear.py), called on each segment's tokens alone, in
the parallel form; forward, final state and gradients are compared. Compiling
dominates: every segment length and every packed call is one program, so the
layout reuses three segment lengths and each packed program holds all forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.linear import (
    LINEAR_FORMS,
    LinearState,
    init_linear_state,
    linear_attention,
    linear_attention_step,
)
from tests.util import rel_err

RTOL = 1e-5  # float32, relative norm-wise error |a-b|/|b|
N, K, H, E = 2, 1, 4, 3  # G = 2 query heads per kv head (GQA)
C = 8  # chunk size: T and every segment length are not multiples of it
# Row 0: segments of 11, 3 and 5 tokens (1 crosses the chunk boundary at 8, two
# boundaries, at 11 and 14, fall inside the chunk [8, 16), 3 crosses 16), then
# padding. Row 1: 5 tokens, padding, 11 tokens of id 8 with one padding token
# inside (it is skipped: the segment spans chunks 0, 1 and 2), 3 tokens, padding.
IDS = np.array(
    [
        [1] * 11 + [2] * 3 + [3] * 5 + [0] * 3,
        [7] * 5 + [0] + [8] * 6 + [0] + [8] * 5 + [9] * 3 + [0],
    ],
    np.int32,
)
B, T = IDS.shape


@dataclass(frozen=True)
class Case:
    causal: bool
    decay: str = "none"  # "none" | "fixed" | "gates"
    feature_map: str = "elu1"
    normalize: bool = True


def make_inputs(ids, seed=0):
    """q, k, v, gamma, log_gates and an initial state for ids ``[B,T]``."""
    rng = np.random.default_rng(seed)
    Bx, Tx = ids.shape
    q = rng.standard_normal((Bx, Tx, N, H)).astype(np.float32)
    k = rng.standard_normal((Bx, Tx, K, H)).astype(np.float32)
    v = rng.standard_normal((Bx, Tx, K, E)).astype(np.float32)
    gamma = np.array([0.8, 0.95], np.float32)
    x = 2.0 * rng.standard_normal((Bx, Tx, N)) + 1.0
    log_gates = (-np.logaddexp(0.0, -x)).astype(np.float32)  # log sigmoid: realistic gates
    kv0 = rng.standard_normal((Bx, N, H, E)).astype(np.float32)
    z0 = rng.uniform(0.5, 1.5, (Bx, N, H)).astype(np.float32)
    return q, k, v, gamma, log_gates, LinearState(kv0, z0)


def run(case, form, q, k, v, gamma, log_gates, state, *, ids=None, eps=1e-6):
    """``linear_attention`` as the case says: ``(out, state)`` causal, ``out`` otherwise."""
    decay = {
        "decay": gamma if case.decay == "fixed" else None,
        "log_gates": log_gates if case.decay == "gates" else None,
    }
    return linear_attention(
        q,
        k,
        v,
        form=form,
        causal=case.causal,
        feature_map=case.feature_map,
        normalize=case.normalize,
        chunk_size=C,
        initial_state=state if case.causal else None,
        return_state=case.causal,
        q_segment_ids=ids,
        kv_segment_ids=ids,
        eps=eps,
        **decay,
    )


@partial(jax.jit, static_argnames=("case",))
def packed_with_grads(case, args, cotangents):
    """For each form: primals and gradients (of <primals, cotangents>) of the packed call."""
    results = {}
    for form in LINEAR_FORMS:
        primals, vjp = jax.vjp(partial(run, case, form, ids=IDS), *args)
        results[form] = primals, vjp(cotangents)
    return results


@partial(jax.jit, static_argnames=("case",))
def alone_with_grads(case, args, cotangents):
    """The same for one segment alone ``[1,L,...]`` (no segment ids), parallel form."""
    primals, vjp = jax.vjp(partial(run, case, "parallel"), *args)
    return primals, vjp(cotangents)


def segment_layout(ids):
    """``(row, positions)`` of every segment, in order, with first/last flags per row."""
    layout = []
    for b, row in enumerate(ids):
        order = [i for i in dict.fromkeys(row.tolist()) if i != 0]
        for j, seg in enumerate(order):
            layout.append((b, np.flatnonzero(row == seg), j == 0, j == len(order) - 1))
    return layout


def expected(case, args, cotangents):
    """Packed results assembled from the segments run alone (zeros on padding)."""
    q, k, v, gamma, log_gates, state = args
    out = np.zeros((B, T, N, E), np.float32)
    grads = [np.zeros_like(np.asarray(x)) for x in (q, k, v, gamma, log_gates)]
    state_grad = [np.zeros_like(x) for x in state]
    final = [np.asarray(x).copy() for x in state]  # a row of padding keeps its state
    for b, pos, first, last in segment_layout(IDS):
        start = jax.tree.map(lambda x, b=b: x[b : b + 1], state)
        if not first:
            start = jax.tree.map(np.zeros_like, start)
        one = (q[b : b + 1, pos], k[b : b + 1, pos], v[b : b + 1, pos], gamma)
        one += (log_gates[b : b + 1, pos], start)
        g_out = cotangents[0][b : b + 1, pos] if case.causal else cotangents[b : b + 1, pos]
        if case.causal:
            g_state = jax.tree.map(lambda x, b=b: x[b : b + 1], cotangents[1])
            g = (g_out, g_state if last else jax.tree.map(np.zeros_like, g_state))
        else:
            g = g_out
        primals, (dq, dk, dv, dgamma, dlog, dstate) = alone_with_grads(case, one, g)
        out[b, pos] = (primals[0] if case.causal else primals)[0]
        for i, d in ((0, dq), (1, dk), (2, dv), (4, dlog)):
            grads[i][b, pos] = d[0]
        grads[3] += np.asarray(dgamma)  # gamma is shared by all segments
        if case.causal and last:
            for x, y in zip(final, primals[1], strict=True):
                x[b] = y[0]
        if case.causal and first:
            for x, y in zip(state_grad, dstate, strict=True):
                x[b] = y[0]
    primals = (out, LinearState(*final)) if case.causal else out
    return primals, (*grads, LinearState(*state_grad))


def assert_rel_close(got, want, what):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        err = rel_err(a, b)
        assert err <= RTOL, f"{what} (leaf {i}): relative error {err:.2e} > {RTOL:.0e}"


CASES = [
    Case(causal=True),
    Case(causal=True, decay="fixed", feature_map="identity", normalize=False),
    Case(causal=True, decay="gates"),
    Case(causal=False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_packed_equals_segments_alone(case):
    args = make_inputs(IDS)
    rng = np.random.default_rng(1)
    g_out = rng.standard_normal((B, T, N, E)).astype(np.float32)
    g_state = LinearState(*(rng.standard_normal(x.shape).astype(np.float32) for x in args[5]))
    cotangents = (g_out, g_state) if case.causal else g_out
    want_primals, want_grads = expected(case, args, cotangents)
    pad = IDS == 0
    # The gradients a case's inputs really get: q, k, v (+ gates, gamma, state).
    used = {"q": 0, "k": 1, "v": 2}
    used |= {"gamma": 3} if case.decay == "fixed" else {}
    used |= {"log_gates": 4} if case.decay == "gates" else {}
    used |= {"initial state": 5} if case.causal else {}
    for form, (primals, grads) in packed_with_grads(case, args, cotangents).items():
        chex.assert_tree_all_finite((primals, grads))
        out = primals[0] if case.causal else primals
        assert np.all(np.asarray(out)[pad] == 0), form  # padding outputs exactly 0
        assert_rel_close(out, want_primals[0] if case.causal else want_primals, f"{form} out")
        if case.causal:
            for name, x, y in zip(("kv", "z"), primals[1], want_primals[1], strict=True):
                assert_rel_close(x, y, f"{form} final {name}")
        for name, i in used.items():
            if i < 5 and i != 3:
                assert np.all(np.asarray(grads[i])[pad] == 0), f"{form} grad {name} on padding"
            assert_rel_close(grads[i], want_grads[i], f"{form} grad of {name}")


def test_noncausal_cross_segments_match_dense():
    """T != S queries over keys with their own ids; an id without keys, padding, eps=0."""
    q_ids = np.array([[1, 1, 2, 0, 3], [5, 0, 5, 5, 6]], np.int32)  # 3 and 6 have no keys
    kv_ids = np.array([[2, 1, 1, 0, 2, 2, 1], [5, 5, 0, 0, 5, 7, 7]], np.int32)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((B, 5, N, H)).astype(np.float32)
    k = rng.standard_normal((B, 7, K, H)).astype(np.float32)
    v = rng.standard_normal((B, 7, K, E)).astype(np.float32)

    def elu1(x):
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))

    vis = (q_ids[:, :, None] == kv_ids[:, None, :]) & (kv_ids[:, None, :] != 0)
    scores = np.einsum("BTNH,BSH->BNTS", elu1(q.astype(np.float64)), elu1(k[:, :, 0]))
    scores = scores * vis[:, None]
    den = scores.sum(-1)
    num = np.einsum("BNTS,BSE->BTNE", scores, v[:, :, 0].astype(np.float64))
    want = num / np.where(den > 0, den, 1.0).transpose(0, 2, 1)[..., None]

    @partial(jax.jit, static_argnames="form")
    def call(form, q, k, v):
        def f(q, k, v):
            return linear_attention(
                q, k, v, form=form, causal=False, chunk_size=4, eps=0.0,
                q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            )  # fmt: skip

        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(jnp.ones_like(out))

    for form in LINEAR_FORMS:
        out, grads = call(form, q, k, v)
        assert_rel_close(out, want, form)
        assert np.all(np.asarray(out)[[0, 0, 1, 1], [3, 4, 1, 4]] == 0), form
        chex.assert_tree_all_finite(grads)
        assert np.all(np.asarray(grads[1])[kv_ids == 0] == 0), form


def test_padding_is_inert_and_steps_agree():
    """A row of padding keeps its state exactly (eps=0: no NaN); steps equal the forms."""
    ids = np.array([[0, 0, 0, 0, 0, 0], [0, 4, 4, 0, 4, 0]], np.int32)
    q, k, v, gamma, log_gates, state = make_inputs(ids, seed=3)
    kw = dict(feature_map="elu1", decay=gamma, eps=0.0)

    @partial(jax.jit, static_argnames="form")
    def call(form, q, k, v, log_gates, state):
        def f(q, k, v, log_gates, state):
            return linear_attention(
                q, k, v, form=form, chunk_size=4, log_gates=log_gates, initial_state=state,
                return_state=True, q_segment_ids=ids, kv_segment_ids=ids, **kw,
            )  # fmt: skip

        primals, vjp = jax.vjp(f, q, k, v, log_gates, state)
        return primals, vjp(jax.tree.map(jnp.ones_like, primals))

    step = jax.jit(partial(linear_attention_step, **kw))
    outs, stepped = [], state
    for t in range(ids.shape[1]):
        before = stepped
        out_t, stepped = step(
            before, q[:, t], k[:, t], v[:, t], log_gate=log_gates[:, t], segment_id=ids[:, t]
        )
        if ids[1, t] == 0:  # a padding step leaves the state exactly as it was
            chex.assert_trees_all_equal(stepped, before)
        outs.append(out_t)
    steps = (jnp.stack(outs, axis=1), stepped)
    np.testing.assert_array_equal(steps[0][ids == 0], 0.0)
    for form in LINEAR_FORMS:
        (out, final), grads = call(form, q, k, v, log_gates, state)
        chex.assert_tree_all_finite((out, final, grads))
        np.testing.assert_array_equal(out[ids == 0], 0.0)
        for x, x0 in zip(final, state, strict=True):
            np.testing.assert_array_equal(x[0], x0[0])  # all padding: the state is untouched
        for g in grads[:4]:
            np.testing.assert_array_equal(np.asarray(g)[ids == 0], 0.0)
        assert_rel_close(out, steps[0], f"{form} vs steps")
        for x, y in zip(final, steps[1], strict=True):
            assert_rel_close(x, y, f"{form} state vs steps")


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        (dict(q_segment_ids=np.ones((B, 9), np.int32)), "q_segment_ids/kv_segment_ids"),
        (dict(q_segment_ids=np.ones((B, 8), np.int32)), "q_segment_ids"),
        (
            dict(q_segment_ids=np.ones((B, 9)), kv_segment_ids=np.ones((B, 9))),
            "q_segment_ids",
        ),
        (
            dict(
                causal=False,
                return_state=True,
                q_segment_ids=np.ones((B, 9), np.int32),
                kv_segment_ids=np.ones((B, 9), np.int32),
            ),
            "return_state",
        ),
    ],
)
def test_bad_segment_ids_raise(kwargs, arg):
    q = np.ones((B, 9, N, H), np.float32)
    k = np.ones((B, 9, K, H), np.float32)
    v = np.ones((B, 9, K, E), np.float32)
    with pytest.raises(ValueError, match=f"^{arg}: expected"):
        linear_attention(q, k, v, **kwargs)
    state = init_linear_state(B, N, H, E)
    with pytest.raises(ValueError, match=r"^segment_id: expected"):
        linear_attention_step(state, q[:, 0], k[:, 0], v[:, 0], segment_id=np.ones((B, 1), int))
