"""Metrics on hand-built attention patterns with known answers, and a loop oracle."""

import jax.numpy as jnp
import numpy as np
import pytest

from analysis import metrics
from attn import masks

T = 8


def one_hot_rows(keys, S=None):
    """``[T,S]`` map whose row t puts all its mass on key ``keys[t]``."""
    keys = np.asarray(keys)
    S = len(keys) if S is None else S
    m = np.zeros((len(keys), S))
    m[np.arange(len(keys)), keys] = 1.0
    return m


def causal_uniform(T):
    return np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]


def stack(heads, B=2):
    """Weights ``[1,B,N,T,S]`` from N per-head ``[T,S]`` maps, the same for every example."""
    w = np.stack(heads)[None, None]
    return np.broadcast_to(w, (1, B, *w.shape[2:])).copy()


def previous_head(T):
    return one_hot_rows(np.maximum(np.arange(T) - 1, 0))


def self_head(T):
    return np.eye(T)


def random_causal(seed, shape):
    """Softmax of random logits under a causal mask: ``[..., T, T]``."""
    logits = np.random.default_rng(seed).standard_normal(shape) * 2
    T = shape[-1]
    logits = np.where(np.tri(T, dtype=bool), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def repeated(B, P, seed=0, bos=False):
    """``r r`` (or ``[BOS] r r[:-1]``, as train's induction task) with distinct r."""
    rng = np.random.default_rng(seed)
    r = np.stack([rng.permutation(np.arange(1, 50))[:P] for _ in range(B)])
    if bos:
        return np.concatenate([np.zeros((B, 1), np.int64), r, r[:, :-1]], axis=1)
    return np.concatenate([r, r], axis=1)


# --- entropy ---------------------------------------------------------------------------------


def test_entropy_known_values():
    half = np.zeros((T, T))
    half[:, :2] = 0.5  # every row: log 2
    w = stack([self_head(T), causal_uniform(T), np.full((T, T), 1 / T), half])
    e = metrics.entropy(w)
    assert e.shape == (1, 4)
    np.testing.assert_allclose(e[0, 0], 0.0, atol=1e-12)
    np.testing.assert_allclose(e[0, 1], metrics.uniform_entropy(T), rtol=1e-12)
    np.testing.assert_allclose(e[0, 2], metrics.uniform_entropy(T, causal=False), rtol=1e-12)
    np.testing.assert_allclose(e[0, 3], np.log(2), rtol=1e-12)


def test_uniform_entropy():
    assert metrics.uniform_entropy(1) == 0.0
    np.testing.assert_allclose(metrics.uniform_entropy(3), (np.log(2) + np.log(3)) / 3)
    np.testing.assert_allclose(metrics.uniform_entropy(5, causal=False), np.log(5))
    # Causal rows see fewer keys, so their baseline is below log T.
    assert metrics.uniform_entropy(T) < np.log(T)


def test_rows_that_see_no_key_are_left_out():
    w = stack([causal_uniform(T), previous_head(T)])
    w[:, 1, :, -3:] = 0.0  # example 1 ends in padding
    expected = np.log(np.arange(1, T + 1))
    e = metrics.entropy(w)
    np.testing.assert_allclose(e[0, 0], (2 * expected[:-3].sum() + expected[-3:].sum()) / 13)
    np.testing.assert_allclose(metrics.previous_token_score(w)[0, 1], 1.0)


# --- previous and duplicate tokens -----------------------------------------------------------


def test_previous_token_score():
    w = stack([previous_head(T), causal_uniform(T), self_head(T)])
    s = metrics.previous_token_score(w)
    np.testing.assert_allclose(s[0], [1.0, np.mean(1 / np.arange(2, T + 1)), 0.0], rtol=1e-12)


def test_duplicate_token_score():
    tokens = np.array([[5, 6, 5, 7, 6, 5], [1, 2, 3, 4, 5, 6]])
    B, T_ = tokens.shape
    # Head 0 splits each query's mass over its earlier copies (itself if none);
    # head 1 puts half of it there and half on itself.
    dup, half = np.zeros((B, T_, T_)), np.zeros((B, T_, T_))
    for b in range(B):
        for t in range(T_):
            earlier = [j for j in range(t) if tokens[b, j] == tokens[b, t]]
            if earlier:
                dup[b, t, earlier] = 1 / len(earlier)
                half[b, t, earlier] = 0.5 / len(earlier)
                half[b, t, t] = 0.5
            else:
                dup[b, t, t] = half[b, t, t] = 1.0
    w = np.stack([dup, half, np.broadcast_to(self_head(T_), (B, T_, T_))], axis=1)[None]
    np.testing.assert_allclose(metrics.duplicate_token_score(w, tokens)[0], [1.0, 0.5, 0.0])


# --- induction ------------------------------------------------------------------------------


def induction_head(T, P, start):
    """Row t >= start on key t - P + 1; earlier rows on key 0."""
    keys = np.zeros(T, int)
    keys[start:] = np.arange(start, T) - P + 1
    return one_hot_rows(keys)


@pytest.mark.parametrize("P", [2, 3, 5])
def test_induction_head_scores_one_and_previous_token_head_does_not(P):
    tokens = repeated(2, P)
    T_ = 2 * P
    w = stack([induction_head(T_, P, P), previous_head(T_)])
    s = metrics.induction_score(w, P, tokens=tokens)
    assert s[0, 0] == 1.0
    # A previous-token head looks at t - 1, the target only when P == 2.
    assert s[0, 1] == (1.0 if P == 2 else 0.0)
    np.testing.assert_array_equal(metrics.induction_score_from_tokens(w, tokens), s)


def test_induction_with_bos_offset_like_the_training_task():
    P = 4
    tokens = repeated(3, P, bos=True)  # [BOS] r r[:-1]: T = 2P
    w = stack([induction_head(2 * P, P, P + 1), causal_uniform(2 * P)], B=3)
    s = metrics.induction_score(w, P, start=P + 1, tokens=tokens)
    assert s[0, 0] == 1.0
    np.testing.assert_allclose(s[0, 1], np.mean(1 / np.arange(P + 2, 2 * P + 1)))
    np.testing.assert_array_equal(metrics.induction_score_from_tokens(w, tokens), s)
    with pytest.raises(ValueError, match=r"tokens: expected tokens\[:, t\] == .* position 4"):
        metrics.induction_score(w, P, tokens=tokens)  # start left at P: off by one


def test_induction_pattern_leaves_out_the_query_itself():
    tokens = np.array([[3, 3, 4, 3]])
    # Query 1 (token 3): the only earlier 3 is at 0, followed by key 1 = itself.
    # Query 3 (token 3): earlier 3s at 0 and 1 are followed by keys 1 and 2.
    expected = np.zeros((1, 4, 4), bool)
    expected[0, 3, [1, 2]] = True
    np.testing.assert_array_equal(metrics.induction_pattern(tokens), expected)


def test_transformer_lens_mul_score_is_ours_times_the_share_of_queries_with_a_target():
    P = 5
    tokens = repeated(1, P)
    w = random_causal(1, (1, 1, 3, 2 * P, 2 * P))
    pattern = metrics.induction_pattern(tokens)[0]
    tl = (w * pattern).sum((1, 3, 4)) / w.sum((1, 3, 4))  # detect_head, error_measure="mul"
    share = pattern.any(-1).mean()
    np.testing.assert_allclose(tl, metrics.induction_score_from_tokens(w, tokens) * share)
    assert share == 0.5  # the first copy has nothing to recall


# --- sinks ------------------------------------------------------------------------------------


def sink_head(T, mass):
    """Row t: ``mass`` on key 0, the rest on itself (row 0: all on key 0)."""
    m = np.eye(T) * (1 - mass)
    m[:, 0] += mass
    m[0, 0] = 1.0
    return m


def test_first_token_mass_and_sink_rate():
    layer0 = [sink_head(T, 0.5), previous_head(T)]
    layer1 = [sink_head(T, 0.5), sink_head(T, 0.5)]
    w = np.concatenate([stack(layer0), stack(layer1)])  # [2,B,2,T,T]
    mass = metrics.first_token_mass(w)
    sink = (1 + 0.5 * (T - 1)) / T  # query 0 sees only key 0
    np.testing.assert_allclose(mass, [[sink, 2 / T], [sink, sink]])
    rate = metrics.sink_rate(w, 0.3)
    assert rate.overall == 0.75
    np.testing.assert_array_equal(rate.per_layer, [0.5, 1.0])
    assert metrics.sink_rate(w, 0.6).overall == 0.0
    assert metrics.sink_rate(w).overall == 0.75  # Gu et al.'s default threshold, 0.3


def test_massive_activations_are_each_layers_largest_magnitude_over_its_median():
    h = np.ones((3, 2, 4, 8))  # [L+1,B,T,D]
    h[1, 0, 0, 5] = -1000.0  # one massive activation after the first block, negative
    h[2] *= 0.5
    got = metrics.massive_activations(h)
    np.testing.assert_array_equal(got.top, [1.0, 1000.0, 0.5])
    np.testing.assert_array_equal(got.median, [1.0, 1.0, 0.5])
    np.testing.assert_array_equal(got.ratio, [1.0, 1000.0, 1.0])


@pytest.mark.parametrize("bad", [np.ones((2, 4, 8)), np.full((2, 1, 4, 8), np.nan)])
def test_massive_activations_refuse_what_is_not_finite_hidden_states(bad):
    with pytest.raises(ValueError, match="hidden"):
        metrics.massive_activations(bad)


def test_first_token_mass_counts_only_queries_that_see_key_0():
    window = 3
    m = np.zeros((T, T))
    for t in range(T):
        lo = max(0, t - window + 1)
        m[t, lo : t + 1] = 1 / (t + 1 - lo)
    w = stack([m])
    mask = masks.causal() & masks.sliding_window(window)
    expected = np.mean([1 / (t + 1) for t in range(window)])
    np.testing.assert_allclose(metrics.first_token_mass(w, mask=mask), [[expected]])
    np.testing.assert_allclose(metrics.first_token_mass(w), [[expected * window / T]])


# --- against a loop oracle ------------------------------------------------------------------


def loop_score(w, targets):
    """Per head: mean over (b, t) with any target of the mass on targets(b, t)."""
    L, B, N, T_, _ = w.shape
    out = np.zeros((L, N))
    for l in range(L):
        for n in range(N):
            rows = [(b, t) for b in range(B) for t in range(T_) if targets(b, t)]
            out[l, n] = np.mean([w[l, b, n, t, targets(b, t)].sum() for b, t in rows])
    return out


def test_metrics_match_loops_on_random_weights():
    L, B, N, T_ = 2, 3, 4, 12
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=(B, T_))  # small vocabulary: many repeats
    w = random_causal(2, (L, B, N, T_, T_))

    def dup(b, t):
        return [j for j in range(t) if tokens[b, j] == tokens[b, t]]

    def ind(b, t):
        return [j for j in range(1, t) if tokens[b, j - 1] == tokens[b, t]]

    np.testing.assert_allclose(metrics.duplicate_token_score(w, tokens), loop_score(w, dup))
    np.testing.assert_allclose(metrics.induction_score_from_tokens(w, tokens), loop_score(w, ind))
    prev = loop_score(w, lambda b, t: [t - 1] if t else [])
    np.testing.assert_allclose(metrics.previous_token_score(w), prev)
    ent = -(w * np.log(np.where(w > 0, w, 1))).sum(-1).mean((1, 3))
    np.testing.assert_allclose(metrics.entropy(w), ent)
    np.testing.assert_allclose(metrics.first_token_mass(w), w[..., 0].mean((1, 3)))


def test_accepts_jax_arrays_and_lists_of_layers():
    w = random_causal(3, (2, 2, 3, T, T)).astype(np.float32)
    expected = metrics.entropy(w)
    np.testing.assert_allclose(metrics.entropy(jnp.asarray(w)), expected)
    np.testing.assert_allclose(metrics.entropy([jnp.asarray(x) for x in w]), expected)
    assert expected.dtype == np.float64


# --- validation -----------------------------------------------------------------------------


def test_validation_errors():
    w = stack([causal_uniform(T)])
    tokens = np.zeros((2, T), np.int64)
    cases = [
        (lambda: metrics.entropy(w[0]), r"w: expected a rank-5 array \[L,B,N,T,S\]"),
        (lambda: metrics.entropy(w - 0.5), "w: expected non-negative attention probabilities"),
        (lambda: metrics.entropy(w * 2), "w: expected rows summing to 1"),
        (lambda: metrics.entropy(w * np.nan), "w: expected finite"),
        (lambda: metrics.entropy([w[0, 0], w[0, 0, :1]]), "w: expected a sequence of L"),
        (lambda: metrics.previous_token_score(w[..., :5, :]), "w: expected self-attention maps"),
        (lambda: metrics.duplicate_token_score(w, tokens[:1]), r"tokens: expected shape \(2, 8\)"),
        (lambda: metrics.duplicate_token_score(w, tokens * 1.0), "tokens: expected integer"),
        (lambda: metrics.duplicate_token_score(w, repeated(2, T)[:, :T]), "tokens: .* twice"),
        (lambda: metrics.induction_score(w, T), r"period: expected an int in \[2, 8\)"),
        (lambda: metrics.induction_score(w, 1), "period: expected an int in"),
        (lambda: metrics.induction_score(w, 3, start=2), r"start: expected an int in \[3, 8\)"),
        (lambda: metrics.induction_score(w, 3, start=T), "start: expected"),
        (lambda: metrics.sink_rate(w, 1.0), r"threshold: expected a number in \[0, 1\)"),
        (lambda: metrics.first_token_mass(w, mask="causal"), "mask: expected an attn.masks"),
        (lambda: metrics.pattern_score(w, np.ones((T, T))), "pattern: expected a bool"),
        (lambda: metrics.pattern_score(w, np.zeros((T, T), bool)), "w: expected .* target key"),
        (lambda: metrics.uniform_entropy(0), "T: expected an int >= 1"),
        (lambda: metrics.uniform_entropy(4, causal=1), "causal: expected a bool"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
