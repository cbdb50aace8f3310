"""A gate of 0 (log gate ``-inf``) means one thing in every family that takes gates.

Where a family's gate scales everything before it (FoX's modifier in every
softmax implementation and a decode step over its running sums, PaTH-FoX in
both forms, gated linear attention, the gated delta rule), a gate of 0 at token
t forgets all that came before: the call equals the same tokens packed as two
sequences split at t (the gate's own value then unused), forward and gradients,
with no NaN. The DPLR rule and log-linear attention, whose gate of 0 does not
end a sequence, are held to their float64 references with such gates in their
own tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import masks, scores
from attn.pallas import flash_attention
from tests.util import normal, qkv, rel_err

B, T, N, H = 1, 12, 2, 8
CUT = 5  # the token whose gate is 0
TOL = 2e-6


def gates():
    """Log gates ``[B,T,N]`` in (-0.5, 0) with a gate of 0 at ``CUT``, and the same with a
    finite gate there (the packed call's, whose segment starts at ``CUT``)."""
    g = -0.5 * jax.nn.sigmoid(normal(1, (B, T, N)))
    return g.at[:, CUT].set(-jnp.inf), g


SEG = jnp.asarray([[1] * CUT + [2] * (T - CUT)], jnp.int32)


def fox(impl):
    fn = {
        "dense": attn.dot_product_attention,
        "blockwise": functools.partial(attn.blockwise_attention, block_q=4, block_k=4),
        "pallas": functools.partial(flash_attention, block_q=16, block_k=16, interpret=True),
    }[impl]

    def call(q, k, v, g, seg):
        return fn(q, k, v, mask=masks.causal(), score_mod=scores.forgetting(g),
                  q_segment_ids=seg, kv_segment_ids=seg)  # fmt: skip

    return call


def fox_decode(q, k, v, g, seg):
    """The last 3 rows as a prefill chunk over cached keys, from running sums."""
    sums = scores.gate_sums(g)
    mod = scores.Forgetting.between(*(scores.GateSums(*(x[:, -3:] for x in sums)), sums))
    return attn.attention(q[:, -3:], k, v, mask=masks.causal(), score_mod=mod,
                          q_positions=jnp.arange(T - 3, T)[None],
                          q_segment_ids=None if seg is None else seg[:, -3:],
                          kv_segment_ids=seg)  # fmt: skip


def path(form):
    w = normal(2, (B, T, N, H))
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    beta = 2 * jax.nn.sigmoid(normal(3, (B, T, N)))

    def call(q, k, v, g, seg):
        return attn.path_attention(q, k, v, w, beta, log_forget=g, form=form, block_size=4,
                                   q_segment_ids=seg, kv_segment_ids=seg)  # fmt: skip

    return call


def gated_linear(q, k, v, g, seg):
    return attn.linear_attention(q, k, v, log_gates=g, feature_map="identity", normalize=False,
                                 chunk_size=4, q_segment_ids=seg, kv_segment_ids=seg)  # fmt: skip


def gated_delta(q, k, v, g, seg):
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(normal(6, (B, T, N)))
    return attn.delta_rule(q, k, v, beta, log_gates=g, chunk_size=4, q_segment_ids=seg,
                           kv_segment_ids=seg)  # fmt: skip


CALLS = {
    **{f"fox_{impl}": fox(impl) for impl in ("dense", "blockwise", "pallas")},
    "fox_decode_over_sums": fox_decode,
    **{f"path_fox_{form}": path(form) for form in attn.PATH_FORMS},
    "gated_linear": gated_linear,
    "gated_delta": gated_delta,
}


@pytest.mark.parametrize("name", CALLS)
def test_a_gate_of_zero_ends_a_sequence_forward_and_gradients(name):
    call = CALLS[name]
    q, k, v = qkv(4, B=B, T=T, N=N, H=H)
    zero, finite = gates()
    cot = normal(5, jax.eval_shape(call, q, k, v, finite, SEG).shape)

    def loss(q, k, v, g, seg):
        return (call(q, k, v, g, seg) * cot).sum()

    # One program for both calls: the gate of 0 runs as one sequence (every id 1).
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    one = jnp.ones_like(SEG)
    (got, got_grads), (want, want_grads) = grad(q, k, v, zero, one), grad(q, k, v, finite, SEG)
    assert np.isfinite(got) and rel_err(got, want) <= TOL
    for x, (g, w) in zip("qkvg", zip(got_grads, want_grads, strict=True), strict=True):
        assert np.isfinite(np.asarray(g)).all(), f"{name}: d{x} has a NaN"
        if x == "g":  # the gate at CUT is used by neither call
            g, w = g.at[:, CUT].set(0.0), w.at[:, CUT].set(0.0)
        assert rel_err(g, w) <= TOL, f"{name}: d{x}"


def test_concrete_gates_carry_zero_counts_only_when_a_gate_is_0():
    """Built from concrete gates, the modifier has zero counts only if a gate is 0 (so a
    call without one compiles as before), and either way it is the packed call."""
    zero, finite = gates()
    assert scores.forgetting(zero).q_zeros is not None
    assert scores.forgetting(finite).q_zeros is None
    q, k, v = qkv(4, B=B, T=T, N=N, H=H)
    got = attn.dot_product_attention(
        q, k, v, mask=masks.causal(), score_mod=scores.forgetting(zero)
    )
    want = fox("dense")(q, k, v, finite, SEG)
    assert rel_err(got, want) <= TOL
