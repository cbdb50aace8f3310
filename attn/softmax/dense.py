"""Materialized softmax attention: the reference every other implementation is tested against.

It reads the call contract of ``attn.softmax.call`` (argument checks, the
visibility rule, logit shaping) like every other implementation, so all agree
on semantics by construction.
"""

from __future__ import annotations

import functools
from typing import Unpack

import chex
import jax
import jax.numpy as jnp

from attn import checks, scores
from attn.checks import as_arrays, fail
from attn.softmax.call import MASKED, Call, CallArgs, check_call, takes_call_args, visible


@takes_call_args
def dot_product_attention(
    q,
    k,
    v,
    *,
    bias=None,
    return_weights: bool = False,
    return_lse: bool = False,
    **call_args: Unpack[CallArgs],
):
    """Softmax attention with the ``[T,S]`` weights materialized.

    ``out[b,t,n] = sum_s w[b,n,t,s] v[b,s,n//G]`` with
    ``w = softmax_s(mod(cap(scale * q.k)) + bias)`` over the keys the mask, the
    positions and the segment ids make visible. A query with no visible key
    gets zeros (and zero gradients), unlike ``jax.nn.dot_product_attention``,
    which returns the mean of V. Statistics are float32 for every input dtype.

    Args:
      q: ``[B,T,N,H]`` queries.
      k: ``[B,S,K,H]`` keys, ``N % K == 0`` (MHA, GQA, MQA).
      v: ``[B,S,K,E]`` values.
      bias: additive logits, rank 4, broadcastable to ``[B,N,T,S]``.
      return_weights: also return the float32 weights ``[B,N,T,S]``.
      return_lse: also return the float32 log-sum-exp ``[B,T,N]`` of the visible
        logits (and sink); ``-inf`` for a row that sees nothing.
      **call_args: the call's keyword arguments, those of every softmax
        implementation (``attn.softmax.call.CallArgs``): ``mask``, ``scale``,
        ``softcap``, ``score_mod``, ``sink_logits``, ``q_positions``,
        ``kv_positions``, ``q_segment_ids``, ``kv_segment_ids``.

    Returns:
      ``out [B,T,N,E]`` in q's dtype, then the weights and/or the lse if asked.
    """
    q, k, v = as_arrays(q, k, v)
    call = check_call(q, k, v, **call_args)
    return attend(call, q, k, v, bias=bias, return_weights=return_weights, return_lse=return_lse)


def attend(call: Call, q, k, v, *, bias=None, return_weights=False, return_lse=False):
    """``dot_product_attention`` of a checked call (see there)."""
    return _dense(call, q, k, v, bias, return_weights=bool(return_weights),
                  return_lse=bool(return_lse))  # fmt: skip


# Jitted at the boundary so eager callers compile once per shape instead of
# dispatching op by op; inside a caller's jit it is inlined.
@functools.partial(jax.jit, static_argnames=("return_weights", "return_lse"))
def _dense(c: Call, q, k, v, bias, *, return_weights, return_lse):
    B, T, S, N, K, G, H, E = c.dims
    q, k, v = c.isolate(q, k, v)
    qg = q.reshape(B, T, K, G, H)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    chex.assert_shape(s, (B, K, G, T, S))
    s = _modified(c, s * c.scale)
    if bias is not None:
        s = s + _grouped_bias(bias, c.dims)
    ok = visible(c.mask, c.q_positions, c.kv_positions, c.q_segment_ids, c.kv_segment_ids)
    ok = ok[:, None, None]  # [B,1,1,T,S]
    s = jnp.where(ok, s, MASKED)

    m = s.max(-1, keepdims=True)
    if c.sink_logits is not None:
        m = jnp.maximum(m, c.sink_logits[None, :, :, None, None])
    # The max only stabilizes exp(); softmax does not depend on it.
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(ok, jnp.exp(_at_most_zero(s - m)), 0.0)
    denom = p.sum(-1, keepdims=True)
    if c.sink_logits is not None:
        denom = denom + jnp.exp(_at_most_zero(c.sink_logits[None, :, :, None, None] - m))
    w = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("BKGTS,BSKE->BTKGE", w, v.astype(jnp.float32))
    out = out.reshape(B, T, N, E).astype(q.dtype)
    chex.assert_shape(w, (B, K, G, T, S))

    extras = []
    if return_weights:
        extras.append(w.reshape(B, N, T, S))
    if return_lse:
        lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
        extras.append(lse[..., 0].reshape(B, N, T).transpose(0, 2, 1))
    return (out, *extras) if extras else out


def modifier_bias(c):
    """The call's additive modifier materialized: float32 ``[B,N,T,S]`` (for jax.nn's bias)."""
    B, T, S, N, K, G, *_ = c.dims
    return _modified(c, jnp.zeros((B, K, G, T, S), jnp.float32)).reshape(B, N, T, S)


def _modified(c: Call, s):
    """``s [B,K,G,T,S]`` through the call's modifier (soft-cap included)."""
    structure, leaves = scores.split(c.score)
    if structure is None:
        return s
    B, T, S, _, K, G, *_ = c.dims

    def view(role, x):
        if role == "head":  # [N, ...] -> [1,K,G,1,1, ...]
            return x.reshape(1, K, G, 1, 1, *x.shape[1:])
        length = T if role == "q" else S
        x = x.reshape(B, length, K, G).transpose(0, 2, 3, 1)  # [B,K,G,L]
        return x[..., None] if role == "q" else x[..., None, :]

    views = {role: [view(role, x) for x in xs] for role, xs in structure.by_role(leaves).items()}
    q_pos, k_pos = c.q_positions[:, None, None, :, None], c.kv_positions[:, None, None, None, :]
    return structure.apply(s, q_pos, k_pos, views)


def _at_most_zero(x):
    """``min(x, 0)`` in value, ``x`` in gradient.

    ``s - max(s) <= 0``, but XLA may compute the s in the max and the s in the
    difference in two roundings (fusing the scale into the dot in one of them):
    at logits of 1e9 and more they differ by ulps of thousands, and exp() of
    that overflows. The guard moves the value only: ``jnp.minimum`` (or a
    select) would halve or cut the gradient wherever rounding lands at or
    above 0, i.e. at the max itself.
    """
    return x - jax.lax.stop_gradient(jnp.maximum(x, 0.0))


def _grouped_bias(bias, d: checks.Dims):
    """Float32 ``[B|1, K, G, T|1, S|1]`` view of a bias broadcastable to ``[B,N,T,S]``."""
    bias = jnp.asarray(bias)
    if bias.ndim != 4:
        fail("bias", f"a rank-4 array broadcastable to ({d.B}, {d.N}, {d.T}, {d.S})", bias.shape)
    try:
        jnp.broadcast_shapes(bias.shape, (d.B, d.N, d.T, d.S))
    except ValueError:
        fail("bias", f"a shape broadcastable to ({d.B}, {d.N}, {d.T}, {d.S})", bias.shape)
    bias = jnp.broadcast_to(bias, (bias.shape[0], d.N, bias.shape[2], bias.shape[3]))
    return bias.reshape(bias.shape[0], d.K, d.G, *bias.shape[2:]).astype(jnp.float32)
