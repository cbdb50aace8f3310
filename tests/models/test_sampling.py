"""Sampling: the distribution each filter leaves (against NumPy, over many draws), the
options' checks, log-probabilities, and generate == serve for the same key."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.sampling import sample, sampling
from tests.models.common import model_for, tokens

V = 12
LOGITS = np.random.default_rng(0).normal(0.0, 1.5, V).astype(np.float32)
DRAWS = 40_000
# (temperature, top_k, top_p, min_p): each filter alone, and all of them together.
CASES = [
    (0.7, 5, None, None),
    (1.3, None, 0.8, None),
    (1.0, None, None, 0.15),
    (0.9, 8, 0.9, 0.05),
    (1.0, None, None, None),
]


def reference(temperature, top_k, top_p, min_p) -> np.ndarray:
    """The distribution ``models.sampling`` describes, in float64 NumPy."""
    z = LOGITS.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    ranked = np.sort(probs)[::-1]
    keep = probs >= ranked[(top_k or V) - 1]
    if top_p is not None:
        top = ranked[: top_k or V]
        above = np.cumsum(top) - top
        keep &= probs >= top[above < top_p * top.sum()].min()
    if min_p is not None:
        keep &= probs >= min_p * ranked[0]
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_filter_leaves_the_distribution_it_describes(case):
    """Chi-square over 40,000 draws (critical value at p = 1e-4, Wilson-Hilferty), and no
    draw outside what the filters keep."""
    options = sampling(*case, key=jax.random.PRNGKey(0), eos_id=None, V=V)
    keys = jax.random.split(jax.random.PRNGKey(1), DRAWS)
    draws = jax.jit(sample)(jnp.broadcast_to(LOGITS, (DRAWS, V)), keys, options)
    counts = np.bincount(np.asarray(draws), minlength=V)
    want = reference(*case)
    assert not counts[want == 0].any()
    seen = want > 0
    expected = DRAWS * want[seen]
    chi2 = float(((counts[seen] - expected) ** 2 / expected).sum())
    df = int(seen.sum()) - 1
    z = 3.719  # the standard normal's 1 - 1e-4 quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3 if df else 0.0
    assert chi2 <= critical, (chi2, critical, counts, want)


def test_a_tiny_temperature_samples_the_argmax():
    """Logits / 1e-20 overflow to +-inf: the probabilities must still be the argmax's one-hot
    (they were NaN, and every draw token 0)."""
    options = sampling(1e-20, None, None, None, key=jax.random.PRNGKey(0), eos_id=None, V=V)
    logits = jnp.asarray(np.random.default_rng(2).normal(0.0, 1.5, (64, V)), jnp.float32)
    draws = jax.jit(sample)(logits, jax.random.split(jax.random.PRNGKey(1), 64), options)
    want = np.argmax(np.asarray(logits), axis=-1)
    assert len(set(want.tolist())) > 1  # not all token 0
    np.testing.assert_array_equal(draws, want)


def test_options_are_checked():
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match=r"^top_k: expected None at temperature 0 \(greedy"):
        sampling(0.0, 5, None, None, key, None, V)
    with pytest.raises(ValueError, match=r"^top_p: expected None at temperature 0"):
        sampling(0.0, None, 0.9, None, key, None, V)
    with pytest.raises(ValueError, match=r"^top_p: expected None or a number in \(0, 1\]"):
        sampling(1.0, None, 0.0, None, key, None, V)
    with pytest.raises(ValueError, match=r"^min_p: expected None or a number in \[0, 1\)"):
        sampling(1.0, None, None, 1.0, key, None, V)
    with pytest.raises(ValueError, match=r"^temperature: expected a finite number >= 0"):
        sampling(float("inf"), None, None, None, key, None, V)
    with pytest.raises(ValueError, match=r"^key: expected a jax.random key"):
        sampling(1.0, None, None, None, None, None, V)


@pytest.mark.integration  # the fast tier's 4 minutes are full
def test_generate_and_serve_draw_the_same_tokens_and_logprobs():
    """Row b of ``generate`` and request b of ``serve`` use the same keys; the log-probs are
    the model's own, and one key per row given explicitly is the same as their default."""
    model = model_for(("mha", "fox", "window"))
    prompts = [np.asarray(tokens(9, (n,))) for n in (1, 6, 3, 9)]
    kw = dict(temperature=0.8, top_p=0.9, key=jax.random.PRNGKey(3))
    got, logprobs = models.generate(model, prompts, 6, return_logprobs=True, **kw)
    served, logits, served_logprobs = models.serve(
        model, prompts, 6, batch=2, max_len=20, return_logits=True, return_logprobs=True, **kw
    )
    for r in range(len(prompts)):
        np.testing.assert_array_equal(served[r], np.asarray(got[r]))
        want = jax.nn.log_softmax(jnp.asarray(logits[r]), axis=-1)[jnp.arange(6), served[r]]
        np.testing.assert_allclose(served_logprobs[r], want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(logprobs[r]), want, rtol=1e-4, atol=1e-5)
    per_row = jax.vmap(lambda b: jax.random.fold_in(kw["key"], b))(jnp.arange(4))
    again = models.generate(model, prompts, 6, **{**kw, "key": per_row})
    np.testing.assert_array_equal(again, got)
