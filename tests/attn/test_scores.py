"""Score modifiers (``attn.scores``) in every softmax implementation, against the papers.

The oracle is float64 attention with each bias built from its paper's formula
(ALiBi's ``-m (i - j)``, T5's log-spaced buckets written out with ``log``,
FoX's ``D[i, j] = sum_{l=j+1..i} log f_l`` as an explicit sum, not our
running-sum difference), differentiated by ``jax.grad`` in float64: forward,
the input gradients and the gradients of the modifiers' own arrays, in every
implementation whose ``attn.dispatch.CAPABILITIES`` cover the case. Ring
attention's cases are in ``tests/devices/test_ring.py`` (8 fake devices).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks, scores
from attn.pallas import flash_attention, splash_attention
from tests.attn.impls import SMALL_FLOAT32, attend, impls_with
from tests.util import normal, qkv, rel_err

TOL = 1e-5  # float32 against float64
GRAD_TOL = 2e-5


# --- the papers' definitions, float64 -------------------------------------------------


def t5_bucket(d, num_buckets, max_distance, bidirectional):
    """T5's bucket of query-minus-key distances ``d`` (int array), written from the paper."""
    d = np.asarray(d, np.int64)
    half = num_buckets // 2 if bidirectional else num_buckets
    exact = half // 2
    offset = np.where(d < 0, half, 0) if bidirectional else 0
    n = np.abs(d) if bidirectional else np.maximum(d, 0)
    with np.errstate(divide="ignore"):
        large = exact + np.floor(
            np.log(np.maximum(n, 1) / exact) / np.log(max_distance / exact) * (half - exact)
        )
    large = np.minimum(large, half - 1).astype(np.int64)
    return offset + np.where(n < exact, n, large)


def fox_bias(log_forget, q_pos, k_pos):
    """``D[b,n,i,j] = sum_{l=j+1..i} log f_l`` at absolute positions (zero where j >= i)."""
    L = log_forget.shape[1]
    l = np.arange(L)
    between = (l[None, None, :] > k_pos[:, None, :, None]) & (l <= q_pos[:, :, None, None])
    # between [B,T,S,L] -> [B,N,T,S]
    return jnp.einsum("btsl,bln->bnts", jnp.asarray(between, log_forget.dtype), log_forget)


def oracle(q, k, v, mods, *, mask, q_pos, k_pos, seg=None, softcap=None, sink=None):
    """Float64 attention with the modifiers' biases from their definitions (jnp, differentiable).

    ``mods``: a list of ``(kind, leaf, settings)``; returns ``out [B,T,N,E]``.
    """
    N, H = q.shape[2:]
    G = N // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * H**-0.5
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # [B,T,S] NumPy
    for kind, leaf, kw in mods:
        if kind == "softcap":
            s = kw * jnp.tanh(s / kw)
        elif kind == "alibi":
            s = s - leaf[None, :, None, None] * np.abs(dist)[:, None]
        elif kind == "t5":
            bucket = t5_bucket(dist, **kw)
            s = s + jnp.take(leaf, bucket, axis=1).transpose(1, 0, 2, 3)
        elif kind == "fox":
            s = s + fox_bias(leaf, q_pos, k_pos)
    ok = np.asarray(mask.allowed(q_pos, k_pos))
    if seg is not None:
        ok &= np.asarray(masks.same_segment(*seg))
    ok = ok[:, None]
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink[None, :, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    den = p.sum(-1, keepdims=True)
    if sink is not None:
        den = den + jnp.exp(sink[None, :, None, None] - m)
    w = p / jnp.where(den == 0, 1.0, den)
    return jnp.einsum("bnts,bsne->btne", w, v)


def build(mods, T=None):
    """Our modifier from the ``(kind, leaf, settings)`` list (FoX from the raw gates, T == S)."""
    out = []
    for kind, leaf, kw in mods:
        if kind == "softcap":
            out.append(scores.softcap(kw))
        elif kind == "alibi":
            out.append(scores.alibi(leaf))
        elif kind == "t5":
            out.append(scores.relative_bias(leaf, **kw))
        elif kind == "fox":
            c = jnp.cumsum(leaf.astype(jnp.float32), axis=1)
            out.append(scores.Forgetting(c if T is None else c[:, -T:], c))
    return scores.compose(*out)


# --- the cases ------------------------------------------------------------------------


def make_case(name):
    """Inputs and settings of one case: GQA/MQA, T == S or not, masks, segments, sinks."""
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    N = 4
    slopes = jnp.asarray(scores.alibi_slopes(N)) * (1 + 0.1 * normal(1, (N,)))
    if name == "alibi_t5_softcap_gqa_sinks":
        B, T, S, K = 2, 37, 37, 2
        t5 = dict(num_buckets=8, max_distance=20, bidirectional=False)
        mods = [("alibi", slopes, None), ("t5", normal(2, (N, 8)), t5)]
        extra = dict(mask=masks.causal(), softcap=5.0, sink=normal(3, (N,)))
    elif name == "fox_alibi_segments_mqa":
        B, T, S, K = 2, 37, 37, 1
        log_f = jnp.asarray(np.log(rng.uniform(0.5, 1.0, (B, T, N))), jnp.float32)
        mods = [("fox", log_f, None), ("alibi", slopes, None)]
        # Row 0 packs two sequences and 5 padding tokens; row 1 is one sequence.
        seg = np.array([[1] * 20 + [2] * 12 + [0] * 5, [1] * 37], np.int32)
        extra = dict(mask=masks.causal(), seg=(seg, seg))
    else:  # "softcap_t5_bidirectional_window_t_ne_s"
        B, T, S, K = 1, 13, 37, 2
        t5 = dict(num_buckets=16, max_distance=24, bidirectional=True)
        mods = [("softcap", None, 3.0), ("t5", normal(4, (N, 16)), t5)]
        extra = dict(mask=masks.bidirectional_window(9))
    q, k, v = qkv(hash(name) % 1000, B=B, T=T, S=S, N=N, K=K, H=8)
    q_pos = np.broadcast_to(np.arange(T) + S - T, (B, T))
    k_pos = np.broadcast_to(np.arange(S), (B, S))
    return (q, k, v), mods, extra, (q_pos, k_pos)


# Each case's needs (attn.dispatch.FLAGS), beside its float32 inputs of head dim 8.
NEEDS = {
    "alibi_t5_softcap_gqa_sinks": ("score_mod", "softcap", "sink"),
    "fox_alibi_segments_mqa": ("score_mod",),
    "softcap_t5_bidirectional_window_t_ne_s": ("score_mod", "softcap"),
}
CASES = tuple(NEEDS)


def leaves_of(mods):
    return [leaf for _, leaf, _ in mods if leaf is not None]


def with_leaves(mods, leaves):
    it = iter(leaves)
    return [(kind, next(it) if leaf is not None else None, kw) for kind, leaf, kw in mods]


def ours_with_grads(impl, qkv_, mods, extra):
    """Our output and the gradients of q, k, v, the sink and the modifiers' arrays."""
    fn = attend(impl, block_q=16, block_k=8)
    seg = extra.get("seg")
    cot = normal(9, qkv_[0].shape[:3] + qkv_[2].shape[3:])

    def loss(q, k, v, sink, leaves):
        mod = build(with_leaves(mods, leaves), T=q.shape[1] if q.shape[1] != k.shape[1] else None)
        out = fn(
            q, k, v, mask=extra["mask"], softcap=extra.get("softcap"), score_mod=mod,
            sink_logits=sink, q_segment_ids=None if seg is None else seg[0],
            kv_segment_ids=None if seg is None else seg[1],
        )  # fmt: skip
        return (out * cot).sum(), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    grads, out = grad(*qkv_, extra.get("sink"), leaves_of(mods))
    return out, grads, cot


def oracle_with_grads(qkv_, mods, extra, positions, cot):
    with jax.enable_x64(True):
        f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)  # noqa: E731
        seg = extra.get("seg")

        def loss(q, k, v, sink, leaves):
            out = oracle(
                q, k, v, with_leaves(mods, leaves), mask=extra["mask"], q_pos=positions[0],
                k_pos=positions[1], seg=seg, softcap=extra.get("softcap"), sink=sink,
            )  # fmt: skip
            return (out * f64(cot)).sum(), out

        leaves = [f64(x) for x in leaves_of(mods)]
        grads, out = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
            *map(f64, qkv_), f64(extra.get("sink")), leaves
        )
        return np.asarray(out), jax.tree.map(np.asarray, grads)


IMPL_CASES = [(impl, case) for case in CASES for impl in impls_with(*SMALL_FLOAT32, *NEEDS[case])]


@pytest.mark.parametrize("impl, case", IMPL_CASES)
def test_modifiers_match_the_papers_forward_and_gradients(impl, case):
    qkv_, mods, extra, positions = make_case(case)
    out, grads, cot = ours_with_grads(impl, qkv_, mods, extra)
    want, want_grads = oracle_with_grads(qkv_, mods, extra, positions, cot)
    assert rel_err(out, want) <= TOL
    names = ["q", "k", "v", "sink"] + [f"{kind} leaf" for kind, leaf, _ in mods if leaf is not None]
    got, expected = [*grads[:4], *grads[4]], [*want_grads[:4], *want_grads[4]]
    for name, g, w in zip(names, got, expected, strict=True):
        if w is None:
            continue
        assert np.isfinite(np.asarray(g)).all(), name
        assert rel_err(g, w) <= GRAD_TOL, f"{impl} {case}: d {name}"
    if "seg" in extra:  # padding rows output zeros
        pad = np.asarray(extra["seg"][0]) == 0
        assert pad.any() and np.all(np.asarray(out)[pad] == 0)


@pytest.mark.parametrize("impl", impls_with(*SMALL_FLOAT32, "score_mod"))
def test_decode_and_prefill_chunks_equal_the_forward(impl):
    """The last rows computed alone (a decode step, a chunk) equal the full pass, per modifier."""
    (q, k, v), mods, *_ = make_case("fox_alibi_segments_mqa")
    t5 = dict(num_buckets=8, max_distance=20, bidirectional=False)
    mods = [*mods, ("t5", normal(5, (4, 8)), t5)]
    full = attn.dot_product_attention(q, k, v, mask=masks.causal(), score_mod=build(mods))
    fn = attend(impl, block_q=4, block_k=8)
    # Jitted: jax.nn's route materializes the modifier op by op when eager.
    run = jax.jit(lambda q, mod: fn(q, k, v, mask=masks.causal(), score_mod=mod))
    for t in (1, 5):
        part = run(q[:, -t:], build(mods, T=t))
        assert rel_err(part, full[:, -t:]) <= TOL, (impl, t)


def test_fox_equals_its_recurrence_free_definition_with_zero_gates():
    """Gates of 1 (log 0) leave softmax attention unchanged; FoX's bias is <= 0 under causal."""
    q, k, v = qkv(3, B=1, T=9, N=2, H=8)
    plain = attn.dot_product_attention(q, k, v, mask=masks.causal())
    ones = scores.forgetting(jnp.zeros((1, 9, 2)))
    np.testing.assert_allclose(
        attn.dot_product_attention(q, k, v, mask=masks.causal(), score_mod=ones), plain, atol=1e-6
    )
    bias = attn.softmax.dense.modifier_bias(
        attn.softmax.call.check_call(
            q, k, v, score_mod=scores.forgetting(jnp.full((1, 9, 2), -0.5))
        )
    )
    i, j = np.tril_indices(9)
    np.testing.assert_allclose(np.asarray(bias)[0, 0][i, j], -0.5 * (i - j), atol=1e-6)


def test_alibi_slopes_are_the_papers():
    np.testing.assert_allclose(scores.alibi_slopes(8), [2.0**-i for i in range(1, 9)])
    # Not a power of two: the 4-head slopes, then every other one of the 8-head sequence.
    want = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    np.testing.assert_allclose(scores.alibi_slopes(6), want)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_buckets_are_t5s(bidirectional):
    d = np.arange(-300, 301)
    for nb, md in ((32, 128), (8, 20), (16, 24)):
        got = np.asarray(scores.relative_buckets(jnp.asarray(d), nb, md, bidirectional))
        np.testing.assert_array_equal(got, t5_bucket(d, nb, md, bidirectional), f"{nb}, {md}")
        assert got.min() == 0 and got.max() == nb - 1


def test_a_modifier_is_a_pytree_traced_once_per_kind():
    traces = []

    @jax.jit
    def f(q, k, v, mod):
        traces.append(1)
        return attn.dot_product_attention(q, k, v, mask=masks.causal(), score_mod=mod)

    q, k, v = qkv(4, B=1, T=6, N=2, H=8)
    f(q, k, v, scores.alibi(jnp.ones(2)))
    f(q, k, v, scores.alibi(jnp.full(2, 0.5)))  # new values: no new trace
    assert len(traces) == 1
    f(q, k, v, scores.alibi(jnp.ones(2)) + scores.softcap(2.0))
    assert len(traces) == 2
    mod = scores.relative_bias(jnp.ones((2, 8)), num_buckets=8) + scores.softcap(3.0)
    leaves = jax.tree.leaves(mod)
    assert [x.shape for x in leaves] == [(2, 8)]


def test_softcap_argument_is_the_softcap_modifier():
    q, k, v = qkv(5, B=1, T=7, N=2, H=8)
    a = attn.blockwise_attention(q, k, v, softcap=2.0, block_q=4, block_k=4)
    b = attn.blockwise_attention(q, k, v, score_mod=scores.softcap(2.0), block_q=4, block_k=4)
    np.testing.assert_array_equal(a, b)


def test_jax_nn_takes_an_additive_modifier_as_a_bias():
    q, k, v = qkv(6, B=1, T=8, N=4, K=2, H=8)
    mod = scores.alibi(scores.alibi_slopes(4))
    want = attn.dot_product_attention(q, k, v, mask=masks.causal(), score_mod=mod)
    got = attn.attention(q, k, v, impl="xla", mask=masks.causal(), score_mod=mod)
    assert rel_err(got, want) <= TOL
    with pytest.raises(ValueError, match=r"^impl:.*soft-cap"):
        attn.attention(q, k, v, impl="xla", score_mod=mod + scores.softcap(2.0))


def test_auto_on_a_gpu_sends_a_modifier_to_the_fused_kernel(monkeypatch):
    monkeypatch.setattr(attn.dispatch, "_backend", lambda: "gpu")
    q, k, v = qkv(7, B=1, T=8, N=4, H=64, dtype=jnp.bfloat16)
    kw = dict(mask=masks.causal())
    assert attn.dispatch.choose_impl(q, k, v, **kw) == "cudnn"
    kw["score_mod"] = scores.alibi(scores.alibi_slopes(4))
    assert attn.dispatch.choose_impl(q, k, v, **kw) == "pallas"
    monkeypatch.setattr(attn.dispatch, "_backend", lambda: "tpu")
    assert attn.dispatch.choose_impl(q, k, v, **kw) == "blockwise"  # splash has no such hook


def test_bad_modifiers_are_named():
    q, k, v = qkv(8, B=2, T=6, N=4, K=2, H=8)
    call = functools.partial(attn.dot_product_attention, q, k, v)
    with pytest.raises(ValueError, match=r"^Alibi\.slopes: expected a leading axis of 4"):
        call(score_mod=scores.alibi(jnp.ones(3)))
    with pytest.raises(ValueError, match=r"^RelativeBias\.table: expected a leading axis of 4"):
        call(score_mod=scores.relative_bias(jnp.ones((3, 8)), num_buckets=8))
    with pytest.raises(ValueError, match=r"^RelativeBias\.table: expected shape \(4, 8\)"):
        call(score_mod=scores.RelativeBias(jnp.ones((4, 7)), 8, 20, False))
    with pytest.raises(ValueError, match=r"^Forgetting\.kv_cumulative: expected shape \(2, 6, 4\)"):
        call(score_mod=scores.Forgetting(jnp.zeros((2, 6, 4)), jnp.zeros((2, 5, 4))))
    with pytest.raises(ValueError, match=r"^log_forget: expected per-token"):
        scores.forgetting(None)
    with pytest.raises(ValueError, match=r"^score_mod: expected an attn\.scores\.ScoreMod"):
        call(score_mod=lambda s: s)
    with pytest.raises(ValueError, match=r"^table: expected shape \[N, 32\]"):
        scores.relative_bias(jnp.ones((4, 16)))
    with pytest.raises(ValueError, match=r"^max_distance: expected more than"):
        scores.relative_bias(jnp.ones((4, 32)), max_distance=8)
    with pytest.raises(ValueError, match=r"^cap: expected a positive finite float"):
        scores.softcap(0.0)
    with pytest.raises(ValueError, match=r"^score_mod: expected None or scores\.softcap"):
        splash_attention(q, k, v, score_mod=scores.alibi(jnp.ones(4)), interpret=True)
    with pytest.raises(ValueError, match=r"^platform: expected one of"):
        flash_attention(q, k, v, platform="metal")
    assert math.isclose(float(scores.softcap(2.0).apply(jnp.float32(100.0), 0, 0)), 2.0)


def test_a_modifier_not_declared_additive_is_never_materialized_as_a_bias():
    """A modifier of one's own is evaluated by the tiled and dense forms; jax.nn (and cuDNN),
    which take biases only, refuse it unless it declares ``additive`` (it was dropped)."""

    class Doubled(scores.ScoreMod):
        def apply(self, s, q_pos, k_pos):
            return 2.0 * s

    q, k, v = qkv(6, B=1, T=9, N=2, H=8)
    with pytest.raises(ValueError, match=r"^impl: expected"):
        attn.attention(q, k, v, impl="xla", score_mod=Doubled())
    want = attn.attention(q, k, v, impl="dense", scale=2.0 * 8**-0.5)
    for impl in ("dense", "blockwise"):
        assert rel_err(attn.attention(q, k, v, impl=impl, score_mod=Doubled()), want) <= TOL
