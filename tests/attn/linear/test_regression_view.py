"""The fixed-state families as test-time regression (docs/families.md, "Test-time regression").

One engine, written here from the view's definition and nothing of the families':
a memory ``S`` trained on the sequence, token t taking one step

    S_t = a_t S_{t-1} - beta_t grad_S loss_t(S) at S = a_t S_{t-1}      (retention, then SGD)
    o_t = read(S_t, q_t)

Each family picks the objective ``loss_t``, the rate ``beta_t`` and the retention
``a_t``; the library's own function must equal the engine to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from tests.util import rel_err

RTOL = 1e-5
B, T, N, H = 2, 13, 2, 8


def regress(q, k, v, beta, loss, log_retention=None, read=lambda S, q: q @ S, S0=None,
            decoupled: bool = False):  # fmt: skip
    """The view's recurrence over ``[B,T,N,...]`` arrays (a scan per row and head);
    ``decoupled``: the gradient at the memory before its retention (weight decay, as
    Titans': ``S_t = a_t S_{t-1} - beta_t grad loss_t(S_{t-1})``)."""
    a = jnp.zeros(beta.shape) if log_retention is None else log_retention

    def head(q, k, v, beta, a):
        def step(S, x):
            qt, kt, vt, bt, at = x
            grad = jax.grad(loss)(S, kt, vt)
            S = jnp.exp(at) * S
            S = S - bt * (grad if decoupled else jax.grad(loss)(S, kt, vt))
            return S, read(S, qt)

        S = jnp.zeros((k.shape[-1], v.shape[-1])) if S0 is None else S0
        return jax.lax.scan(step, S, (q, k, v, beta, a))[1]

    per_row = jax.vmap(head, in_axes=(1, 1, 1, 1, 1), out_axes=1)  # over N
    return jax.vmap(per_row)(q, k, v, beta, a)  # over B


def squared(S, k, v):  # the online least-squares objective
    return 0.5 * jnp.sum(jnp.square(k @ S - v))


def inputs(seed):
    rng = np.random.default_rng(seed)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, N)), jnp.float32)
    log_a = -jnp.asarray(rng.uniform(0.0, 0.5, (B, T, N)), jnp.float32)
    return unit(f32(B, T, N, H)), unit(f32(B, T, N, H)), f32(B, T, N, H), beta, log_a


def test_linear_attention_is_one_step_on_a_linear_objective_without_retention():
    q, k, v, _, log_a = inputs(0)
    ones = jnp.ones((B, T, N))
    want = regress(q, k, v, ones, lambda S, k, v: -jnp.dot(k @ S, v))
    got = attn.linear_attention(q, k, v, feature_map="identity", normalize=False, scale=1.0)
    assert rel_err(got, want) <= RTOL
    # With a retention it is decayed linear attention (RetNet's, Mamba-2's SSD as one).
    want = regress(q, k, v, ones, lambda S, k, v: -jnp.dot(k @ S, v), log_retention=log_a)
    got = attn.linear_attention(q, k, v, feature_map="identity", normalize=False, scale=1.0,
                                log_gates=log_a)  # fmt: skip
    assert rel_err(got, want) <= RTOL


@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated_deltanet"])
def test_the_delta_rules_are_online_least_squares(gated):
    """DeltaNet: one step of rate beta on ``1/2 |S^T k - v|^2``; Gated DeltaNet: a
    retention ``exp(g)`` before it."""
    q, k, v, beta, log_a = inputs(1)
    log_a = log_a if gated else None
    want = regress(q, k, v, beta, squared, log_retention=log_a)
    got = attn.delta_rule(q, k, v, beta, log_gates=log_a, scale=1.0)
    assert rel_err(got, want) <= RTOL


def test_ttt_linear_with_mini_batch_1_and_no_norm_is_least_squares_on_its_residual():
    """TTT-Linear without its LayerNorm, a mini-batch of one token: the memory ``[W; b]``
    on keys ``[k, 1]``, the target ``v - k`` (its residual), read ``q + [q, 1] [W; b]``."""
    q, k, v, beta, _ = inputs(2)
    one = jnp.ones((B, T, N, 1))
    kb, qb = jnp.concatenate([k, one], -1), jnp.concatenate([q, one], -1)
    want = q + regress(qb, kb, v - k, beta, squared)
    for form in attn.TTT_FORMS:
        got = attn.ttt_linear(q, k, v, beta, norm_scale=None, norm_bias=None, mini_batch=1,
                              form=form)  # fmt: skip
        assert rel_err(got, want) <= RTOL, form


def test_titans_without_momentum_is_least_squares_with_weight_decay_and_a_dplr_rule():
    """Titans' linear memory without its LayerNorm or momentum, a mini-batch of one token:
    TTT-Linear's objective with weight decay ``1 - alpha`` taken beside the step (at the
    previous memory), which is the DPLR delta rule (RWKV-7's) with ``w = 1 - alpha``,
    ``a = [k, 1]``, ``b = -theta [k, 1]`` and writes ``theta [k, 1] (v - k)^T``."""
    q, k, v, beta, log_a = inputs(3)
    one = jnp.ones((B, T, N, 1))
    kb, qb = jnp.concatenate([k, one], -1), jnp.concatenate([q, one], -1)
    want = q + regress(qb, kb, v - k, beta, squared, log_retention=log_a, decoupled=True)
    no_momentum = jnp.full((B, T, N), -jnp.inf)
    for form in attn.TITANS_FORMS:
        got = attn.titans(q, k, v, beta, no_momentum, log_a, mini_batch=1, form=form)
        assert rel_err(got, want) <= RTOL, form
    w = jnp.broadcast_to(log_a[..., None], kb.shape)
    theta = beta[..., None]
    dplr = attn.dplr_delta_rule(qb, theta * kb, v - k, kb, -theta * kb, w, scale=1.0)
    assert rel_err(q + dplr, want) <= RTOL
