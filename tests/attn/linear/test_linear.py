"""Linear attention: the three forms compute one function (forward and gradients).

Oracles: the forms against each other, the library's float64 reference
(``attn.linear.reference``: its feature maps and ``gated_linear``, a scan over
tokens), and a dense NumPy computation for the non-causal case. Shapes are
shared across tests to keep compilation (most of this file's run time) down.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.linear import (
    FEATURE_MAPS,
    LINEAR_FORMS,
    LinearState,
    favor_projection,
    init_linear_state,
    linear_attention,
    linear_attention_step,
    linear_feature_dim,
    reference,
)
from tests.util import rel_err

RTOL = 1e-5  # float32, relative norm-wise error |a-b|/|b|
BF16_RTOL = 1e-2
B, N, H, E = 2, 4, 4, 3  # K is 4 (MHA) or 2 (GQA)
FAVOR_FEATURES = 16
# Any [H, F] matrix serves the forms' agreement (favor_projection is tested on
# its own below); NumPy keeps the QR out of the compile budget.
PROJECTION = np.random.default_rng(7).standard_normal((H, FAVOR_FEATURES)).astype(np.float32)


def softplus_pair(x):
    """A user-supplied feature map (F = 2H), to test callables."""
    return jnp.concatenate([jax.nn.softplus(x), jax.nn.softplus(-x)], axis=-1)


# ----------------------------------------------------------------------------
# float64 oracles


def features64(name, x):
    """Float64 features of x as NumPy: the reference's maps, or this file's own callable."""
    with jax.enable_x64(True):
        x = jnp.asarray(x, jnp.float64)
        if name == "softplus_pair":
            return np.asarray(softplus_pair(x))
        return np.asarray(reference.feature_map(name, x, projection=PROJECTION))


def np_default_scale(name):
    return H**-0.5 if name in ("taylor", "favor") else 1.0


def oracle(q, k, v, *, feature_map, normalize=True, log_a=None, state=None):
    """Causal linear attention in float64 (``reference.gated_linear`` on the float64
    features), from ``state = (kv, z)``: out and the final (kv, z) as NumPy; log_a
    ``[B,T,N]`` or None."""
    G = q.shape[2] // k.shape[2]
    root = math.sqrt(np_default_scale(feature_map))
    qf = features64(feature_map, np.asarray(q, np.float64) * root)  # [B,T,N,F]
    kf = np.repeat(features64(feature_map, np.asarray(k, np.float64) * root), G, axis=2)
    vv = np.repeat(np.asarray(v, np.float64), G, axis=2)
    with jax.enable_x64(True):
        s64 = None if state is None else tuple(jnp.asarray(x, jnp.float64) for x in state)
        run = jax.jit(partial(reference.gated_linear, normalize=normalize))
        out, kv, z = run(qf, kf, vv, log_a, initial_state=s64)
        return np.asarray(out), (np.asarray(kv), np.asarray(z))


# ----------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Case:
    feature_map: str
    decay: str  # "none" | "fixed" | "gates" | "both"
    T: int
    chunk_size: int
    K: int  # 4: MHA, 2: GQA
    normalize: bool = True

    @property
    def map_arg(self):
        return softplus_pair if self.feature_map == "softplus_pair" else self.feature_map

    @property
    def projection(self):
        return jnp.asarray(PROJECTION) if self.feature_map == "favor" else None


def make_inputs(case: Case, seed: int = 0, dtype=np.float32):
    """q, k, v, gamma, log_gates and an initial state (zeros are a special case of it)."""
    rng = np.random.default_rng(seed)
    F = linear_feature_dim(case.map_arg, H, projection=case.projection)
    q = rng.standard_normal((B, case.T, N, H)).astype(dtype)
    k = rng.standard_normal((B, case.T, case.K, H)).astype(dtype)
    v = rng.standard_normal((B, case.T, case.K, E)).astype(dtype)
    gamma = np.array([0.8, 0.9, 0.97, 1.0], np.float32)[:N]
    # Realistic gates (near 1) with a spread: log sigmoid(x + 2).
    x = 2.0 * rng.standard_normal((B, case.T, N)) + 2.0
    log_gates = (-np.logaddexp(0.0, -x)).astype(np.float32)
    if case.T > 1:
        # A gate of exactly zero (log -inf) erases the state: no NaN may come of it.
        log_gates[0, case.T // 3, 1] = -np.inf
    kv0 = rng.standard_normal((B, N, F, E)).astype(np.float32)
    z0 = rng.uniform(0.5, 1.5, (B, N, F)).astype(np.float32)
    return q, k, v, gamma, log_gates, LinearState(kv0, z0)


def decay_kwargs(case: Case, gamma, log_gates):
    return {
        "decay": gamma if case.decay in ("fixed", "both") else None,
        "log_gates": log_gates if case.decay in ("gates", "both") else None,
    }


def reference_log_a(case: Case, gamma, log_gates):
    log_a = np.zeros((B, case.T, N))
    if case.decay in ("fixed", "both"):
        log_a = log_a + np.log(np.asarray(gamma, np.float64))
    if case.decay in ("gates", "both"):
        log_a = log_a + np.asarray(log_gates, np.float64)
    return None if case.decay == "none" else log_a


def run_case(case, form, chunk_size, q, k, v, gamma, log_gates, state):
    return linear_attention(
        q,
        k,
        v,
        form=form,
        feature_map=case.map_arg,
        normalize=case.normalize,
        chunk_size=chunk_size,
        initial_state=state,
        return_state=True,
        projection=case.projection,
        **decay_kwargs(case, gamma, log_gates),
    )


# One program per (case, form, chunk size), shared by the tests that use a case.
forward = jax.jit(run_case, static_argnames=("case", "form", "chunk_size"))


@partial(jax.jit, static_argnames=("case",))
def all_forms_with_grads(case, q, k, v, gamma, log_gates, state, cotangents):
    """For each form: output and final state, and the gradients of <them, cotangents>."""
    results = {}
    for form in LINEAR_FORMS:
        run = partial(run_case, case, form, case.chunk_size)
        primals, vjp = jax.vjp(run, q, k, v, gamma, log_gates, state)
        results[form] = (primals, vjp(cotangents))
    return results


def cotangents_like(case, seed=1):
    rng = np.random.default_rng(seed)
    F = linear_feature_dim(case.map_arg, H, projection=case.projection)
    out = rng.standard_normal((B, case.T, N, E)).astype(np.float32)
    kv = rng.standard_normal((B, N, F, E)).astype(np.float32)
    return out, LinearState(kv, rng.standard_normal((B, N, F)).astype(np.float32))


def assert_trees_rel_close(got, want, rtol=RTOL, what=""):
    got_leaves, tree = jax.tree.flatten(got)
    want_leaves, tree_want = jax.tree.flatten(want)
    assert tree == tree_want
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        err = rel_err(a, b)
        assert err <= rtol, f"{what} leaf {i}: relative error {err:.2e} > {rtol:.0e}"


# Every feature map, every decay option, every T in {1, 63, 100, 257}, both
# chunk sizes, MHA and GQA, with and without normalization, always with a
# non-zero initial state (whose gradient is then checked too).
CASES = [
    Case("elu1", "gates", 257, 64, 2),
    Case("taylor", "fixed", 63, 16, 4),
    Case("favor", "both", 100, 16, 2),
    Case("identity", "none", 1, 16, 4, normalize=False),
    Case("relu", "none", 63, 64, 2),
    Case("softplus_pair", "none", 100, 64, 4),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forms_agree_forward_and_gradients(case):
    q, k, v, gamma, log_gates, state = make_inputs(case)
    results = all_forms_with_grads(case, q, k, v, gamma, log_gates, state, cotangents_like(case))
    # Gradients of decay/gates are identically zero when unused: compare the used ones.
    used = [0, 1, 2, 5]  # q, k, v, initial state
    used += [3] if case.decay in ("fixed", "both") else []
    used += [4] if case.decay in ("gates", "both") else []
    want_primals, want_grads = results["recurrent"]
    for form in ("parallel", "chunkwise"):
        primals, grads = results[form]
        assert_trees_rel_close(primals, want_primals, what=f"{form} output/state")
        for i in used:
            assert_trees_rel_close(grads[i], want_grads[i], what=f"{form} grad of arg {i}")
    for form in LINEAR_FORMS:
        chex.assert_tree_all_finite(results[form][1])

    want_out, (want_kv, want_z) = oracle(
        q,
        k,
        v,
        feature_map=case.feature_map,
        normalize=case.normalize,
        log_a=reference_log_a(case, gamma, log_gates),
        state=state,
    )
    for form in LINEAR_FORMS:
        out, final = results[form][0]
        assert out.dtype == jnp.float32
        assert rel_err(out, want_out) <= RTOL, form
        assert rel_err(final.kv, want_kv) <= RTOL, form
        assert rel_err(final.z, want_z) <= RTOL, form


def test_chunk_size_one_is_recurrent_and_chunk_beyond_t_is_parallel():
    case = Case("elu1", "gates", 63, 16, 2)
    args = make_inputs(case, seed=3)
    recurrent = forward(case, "recurrent", 16, *args)
    assert_trees_rel_close(forward(case, "chunkwise", 1, *args), recurrent)
    parallel = forward(case, "parallel", 16, *args)
    for chunk_size in (1000,):
        assert_trees_rel_close(forward(case, "chunkwise", chunk_size, *args), parallel)


@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
def test_split_and_resume(form):
    case = Case("elu1", "both", 100, 16, 2)
    q, k, v, gamma, log_gates, state = make_inputs(case, seed=4)
    whole = forward(case, form, 16, q, k, v, gamma, log_gates, state)
    t = 50  # not a multiple of the chunk size; both halves share one program
    first = (q[:, :t], k[:, :t], v[:, :t], gamma, log_gates[:, :t])
    second = (q[:, t:], k[:, t:], v[:, t:], gamma, log_gates[:, t:])
    first_out, mid = forward(case, form, 16, *first, state)
    second_out, final = forward(case, form, 16, *second, mid)
    assert_trees_rel_close((jnp.concatenate([first_out, second_out], axis=1), final), whole)


@pytest.mark.parametrize(
    "case", [Case("elu1", "both", 100, 16, 2), Case("favor", "none", 63, 16, 4)], ids=str
)
def test_step_iterated_equals_recurrent(case):
    q, k, v, gamma, log_gates, state = make_inputs(case, seed=4)
    want = forward(case, "recurrent", 16, q, k, v, gamma, log_gates, state)
    kw = decay_kwargs(case, gamma, log_gates)
    step = jax.jit(
        partial(
            linear_attention_step,
            decay=kw["decay"],
            feature_map=case.map_arg,
            projection=case.projection,
        )
    )
    outs = []
    for t in range(case.T):
        gate = None if kw["log_gates"] is None else kw["log_gates"][:, t]
        out_t, state = step(state, q[:, t], k[:, t], v[:, t], log_gate=gate)
        outs.append(out_t)
    assert_trees_rel_close((jnp.stack(outs, axis=1), state), want)


def test_step_from_zero_state_and_feature_dims():
    assert linear_feature_dim("elu1", 8) == 8
    assert linear_feature_dim("taylor", 8) == 1 + 8 + 64
    assert linear_feature_dim(softplus_pair, 8) == 16
    assert linear_feature_dim("favor", H, projection=PROJECTION) == FAVOR_FEATURES
    state = init_linear_state(B, N, H, E)
    assert state.kv.shape == (B, N, H, E) and state.z.shape == (B, N, H)
    q, k, v = (np.ones((B, N, H)), np.ones((B, 2, H)), np.full((B, 2, E), 3.0))
    step = jax.jit(partial(linear_attention_step, feature_map="relu", eps=0.0))
    out, new = step(state, q, k, v)
    np.testing.assert_allclose(out, 3.0, rtol=1e-6)  # one key: the output is its value
    assert new.z.shape == (B, N, H)


@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_bf16_inputs_float32_state(form):
    case = Case("elu1", "gates", 63, 16, 2)
    q, k, v, gamma, log_gates, state = make_inputs(case, seed=6, dtype=jnp.bfloat16)
    assert q.dtype == jnp.bfloat16
    out, final = forward(case, form, 16, q, k, v, gamma, log_gates, state)
    assert out.dtype == jnp.bfloat16
    assert final.kv.dtype == jnp.float32 and final.z.dtype == jnp.float32
    want, (want_kv, _) = oracle(
        q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
        feature_map="elu1", log_a=np.asarray(log_gates, np.float64), state=state,
    )  # fmt: skip
    assert rel_err(out.astype(jnp.float32), want) <= BF16_RTOL
    # The state is float32 from bf16-exact inputs: float32 accuracy.
    assert rel_err(final.kv, want_kv) <= RTOL


@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
def test_bf16_long_sequence(form):
    T, Hs = 65536, 2
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, T, 1, Hs)).astype(jnp.bfloat16) for _ in range(3))
    out, state = jax.jit(partial(linear_attention, form=form, return_state=True))(q, k, v)
    assert out.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert bool(jnp.all(state.z > 0))
    want, (_, want_z) = oracle(q, k, v, feature_map="elu1")
    qf, kf = (features64("elu1", x[0, :, 0]) for x in (q, k))
    den = np.einsum("tf,tf->t", qf, np.cumsum(kf, axis=0))  # the normalizer
    assert np.all(den > 0)
    assert rel_err(np.asarray(out[0, :, 0], np.float64), want[0, :, 0]) <= BF16_RTOL
    # z is a float32 running sum of T positive terms: its rounding error is bounded
    # by T unit roundoffs (the recurrent form adds one term at a time).
    assert rel_err(state.z[0, 0], want_z[0, 0]) <= T * np.finfo(np.float32).eps / 2


def test_noncausal_equals_dense():
    T, S, K = 7, 11, 2
    rng = np.random.default_rng(10)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, E)).astype(np.float32)
    qf = features64("elu1", q)  # [B,T,N,F]
    kf = np.repeat(features64("elu1", k), N // K, axis=2)
    scores = np.einsum("btnf,bsnf->bnts", qf, kf)
    dense = np.einsum("bnts,bsne->btne", scores, np.repeat(np.asarray(v), N // K, axis=2))
    dense = dense / (np.moveaxis(scores.sum(-1), 1, 2)[..., None] + 1e-6)
    noncausal = jax.jit(partial(linear_attention, causal=False), static_argnames="form")
    for form in LINEAR_FORMS:
        assert rel_err(noncausal(q, k, v, form=form), dense) <= RTOL, form


def test_favor_approximates_softmax_better_with_more_features():
    T, Hf = 64, 8
    rng = np.random.default_rng(11)
    # Moderate logits: the estimator's variance grows like exp(|q + k|^2 / sqrt(H)).
    q, k = (0.5 * rng.standard_normal((1, T, 1, Hf)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, T, 1, Hf)).astype(np.float32)
    exact = jax.nn.dot_product_attention(q, k, v)  # scale 1/sqrt(H), like favor's default
    # Prefixes of one projection are projections too (whole orthogonal blocks).
    projection = np.asarray(favor_projection(jax.random.PRNGKey(11), Hf, 1024))
    favor = jax.jit(partial(linear_attention, causal=False, feature_map="favor", eps=0.0))
    errors = [
        rel_err(favor(q, k, v, projection=projection[:, :F]), exact) for F in (16, 64, 256, 1024)
    ]
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < errors[0] / 4, errors  # Monte Carlo: about 1/sqrt(F)


def test_favor_projection_is_orthogonal_in_blocks():
    # The same call as in the approximation test: one compilation for both.
    w = np.asarray(favor_projection(jax.random.PRNGKey(11), 8, 1024), np.float64)
    assert w.shape == (8, 1024)
    for block in (w[:, :8], w[:, 8:16]):
        gram = block.T @ block
        off_diagonal = gram - np.diag(np.diag(gram))
        assert np.max(np.abs(off_diagonal)) < 1e-4 * np.max(np.diag(gram))


def test_positive_gates_checked_only_when_concrete():
    q = np.ones((B, 9, N, H), np.float32)
    k = np.ones((B, 9, 2, H), np.float32)
    v = np.ones((B, 9, 2, E), np.float32)
    log_gates = np.full((B, 9, N), -0.1, np.float32)
    log_gates[0, 3, 1] = 0.25
    with pytest.raises(ValueError, match="log_gates"):
        linear_attention(q, k, v, log_gates=log_gates)
    # Under a trace the values are unknown: no error (the caller's responsibility).
    out = jax.jit(partial(linear_attention, form="chunkwise"))(q, k, v, log_gates=log_gates)
    assert out.shape == (B, 9, N, E)


def test_feature_maps_exported():
    assert set(FEATURE_MAPS) == {"identity", "elu1", "relu", "silu", "taylor", "favor"}
    x = np.linspace(-2.0, 2.0, 12, dtype=np.float32).reshape(3, H)
    names = ("identity", "elu1", "relu", "silu", "taylor")
    features = jax.jit(lambda x: [FEATURE_MAPS[name](x) for name in names])(x)
    want = [features64(name, x) for name in names]
    chex.assert_trees_all_close(features, want, rtol=1e-6)
    # Taylor features give the second-order expansion of exp(q.k).
    qk = float(x[0] @ x[1])
    taylor_kernel = float(np.dot(features[-1][0], features[-1][1]))
    np.testing.assert_allclose(taylor_kernel, 1 + qk + qk**2 / 2, rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        (dict(form="chunkwise", chunk_size=0), "chunk_size"),
        (dict(form="chunkwise", chunk_size=-4), "chunk_size"),
        (dict(form="blocky"), "form"),
        (dict(feature_map="softmax"), "feature_map"),
        (dict(feature_map="favor"), "projection"),
        (dict(feature_map="favor", projection=np.zeros((H + 1, 8))), "projection"),
        (dict(feature_map="elu1", projection=np.zeros((H, 8))), "projection"),
        (dict(log_gates=np.zeros((B, 5, N))), "log_gates"),
        (dict(log_gates=np.full((B, 9, N), 0.5)), "log_gates"),
        (dict(decay=np.full((3,), 0.9)), "decay"),
        (dict(decay=np.full((N,), 1.5)), "decay"),
        (dict(decay=np.full((N,), 0.9), causal=False), "decay"),
        (dict(scale=-1.0), "scale"),
        (dict(eps=-1.0), "eps"),
        (dict(initial_state=init_linear_state(B, N, H + 1, E)), "initial_state"),
    ],
)
def test_bad_input_raises(kwargs, arg):
    q = np.ones((B, 9, N, H), np.float32)
    k = np.ones((B, 9, 2, H), np.float32)
    v = np.ones((B, 9, 2, E), np.float32)
    # Messages read "<argument>: expected <what>, got <what>".
    with pytest.raises(ValueError, match=f"^{arg}: expected"):
        linear_attention(q, k, v, **kwargs)


def test_bad_shapes_raise():
    ones = partial(np.ones, dtype=np.float32)
    q = ones((B, 9, N, H))
    with pytest.raises(ValueError, match=r"^k: expected length S == T == 9 when causal"):
        linear_attention(q, ones((B, 8, 2, H)), ones((B, 8, 2, E)))
    with pytest.raises(ValueError, match=r"^k: expected a number of kv heads dividing"):
        linear_attention(q, ones((B, 9, 3, H)), ones((B, 9, 3, E)))
    with pytest.raises(ValueError, match=r"^q: expected a rank-4 array"):
        linear_attention(q[0], ones((B, 9, 2, H)), ones((B, 9, 2, E)))
    state = init_linear_state(B, N, H, E)
    with pytest.raises(ValueError, match=r"^v: expected"):
        linear_attention(q, ones((B, 9, 2, H)), ones((B, 7, 2, E)))
    with pytest.raises(ValueError, match=r"^q: expected non-empty axes"):
        linear_attention(q[:, :0], ones((B, 0, 2, H)), ones((B, 0, 2, E)))
    with pytest.raises(ValueError, match=r"^q_t: expected"):
        linear_attention_step(state, q, ones((B, 2, H)), ones((B, 2, E)))
    with pytest.raises(ValueError, match=r"^log_gate: expected"):
        linear_attention_step(
            state, q[:, 0], ones((B, 2, H)), ones((B, 2, E)), log_gate=np.zeros((B,), np.float32)
        )
    with pytest.raises(ValueError, match=r"^state: expected"):
        linear_attention_step(
            state._replace(z=state.z[:, :1]), q[:, 0], ones((B, 2, H)), ones((B, 2, E))
        )
