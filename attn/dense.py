"""Materialized softmax attention: the reference every other implementation is tested against.

The pieces shared with the other softmax implementations (argument checking,
the visibility rule, logit shaping) live here too, so every implementation
agrees on semantics by construction.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from attn import _checks
from attn._checks import fail
from attn.masks import Full, Mask, full

# Masked logits are set to a large finite negative number rather than -inf, so
# no `-inf - -inf` ever reaches exp() and gradients stay finite.
MASKED = -1e30


class Call(NamedTuple):
    """A checked softmax-attention call: sizes and normalized optional arguments."""

    dims: _checks.Dims
    mask: Mask
    scale: float
    softcap: float | None
    sink_logits: jax.Array | None  # [K, G] float32
    q_positions: jax.Array  # [B, T] int32
    kv_positions: jax.Array  # [B, S] int32
    q_segment_ids: jax.Array | None  # [B, T] int32
    kv_segment_ids: jax.Array | None  # [B, S] int32


def check_static(mask, scale, softcap) -> tuple[Mask, float | None, float | None]:
    """Validates the static (hashable, compile-time) arguments; None mask becomes ``full()``."""
    if mask is None:
        mask = full()
    elif not isinstance(mask, Mask):
        fail("mask", "an attn.masks.Mask (e.g. masks.causal()) or None", type(mask).__name__)
    if scale is not None and (not isinstance(scale, numbers.Real) or scale <= 0):
        fail("scale", "a positive float or None", repr(scale))
    if softcap is not None and (not isinstance(softcap, numbers.Real) or softcap <= 0):
        fail("softcap", "a positive float or None", repr(softcap))
    return (
        mask,
        None if scale is None else float(scale),
        None if softcap is None else float(softcap),
    )


def check_call(
    q,
    k,
    v,
    *,
    mask=None,
    scale=None,
    softcap=None,
    sink_logits=None,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
) -> Call:
    """Validates the arguments every softmax implementation shares."""
    d = _checks.qkv_dims(q, k, v)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        fail("q_segment_ids/kv_segment_ids", "both or neither", "only one of them")
    mask, scale, softcap = check_static(mask, scale, softcap)
    if q_positions is None and d.T != d.S and not isinstance(mask, Full):
        # The default queries are the last T key positions: that needs T <= S,
        # and it means nothing against keys placed by explicit kv_positions.
        if d.T > d.S:
            fail(
                "q_positions",
                f"explicit positions for T={d.T} queries over S={d.S} keys (T > S) with mask "
                f"{mask!r}: by default the queries are the last T key positions",
                None,
            )
        if kv_positions is not None:
            fail(
                "q_positions",
                f"explicit positions with kv_positions and T={d.T} != S={d.S} under mask "
                f"{mask!r} (the default, the last T key indices, ignores kv_positions)",
                None,
            )
    scale = d.H**-0.5 if scale is None else scale
    if sink_logits is not None:
        sink_logits = jnp.asarray(sink_logits)
        if sink_logits.shape != (d.N,):
            fail("sink_logits", f"shape ({d.N},), one logit per query head", sink_logits.shape)
        sink_logits = sink_logits.astype(jnp.float32).reshape(d.K, d.G)
    return Call(
        dims=d,
        mask=mask,
        scale=scale,
        softcap=softcap,
        sink_logits=sink_logits,
        q_positions=_checks.positions(q_positions, "q_positions", d.B, d.T, offset=d.S - d.T),
        kv_positions=_checks.positions(kv_positions, "kv_positions", d.B, d.S),
        q_segment_ids=_checks.segment_ids(q_segment_ids, "q_segment_ids", d.B, d.T),
        kv_segment_ids=_checks.segment_ids(kv_segment_ids, "kv_segment_ids", d.B, d.S),
    )


def visible(mask: Mask, q_pos, k_pos, q_seg=None, k_seg=None):
    """Boolean ``[B,T,S]``: the mask on positions, within segments when ids are given.

    Args:
      q_pos: ``[B,T]`` positions; k_pos: ``[B,S]``; q_seg, k_seg: ``[B,T]``, ``[B,S]`` or None.
    """
    ok = mask.allowed(q_pos, k_pos)
    if q_seg is not None:
        ok &= q_seg[:, :, None] == k_seg[:, None, :]
    return ok


def shape_logits(s, scale: float, softcap: float | None):
    """Scales float32 logits and applies the tanh soft-cap (Gemma 2) when given."""
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


def dot_product_attention(
    q,
    k,
    v,
    *,
    mask: Mask | None = None,
    bias=None,
    scale: float | None = None,
    softcap: float | None = None,
    sink_logits=None,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    return_weights: bool = False,
    return_lse: bool = False,
):
    """Softmax attention with the ``[T,S]`` weights materialized.

    ``out[b,t,n] = sum_s w[b,n,t,s] v[b,s,n//G]`` with
    ``w = softmax_s(cap(scale * q.k) + bias)`` over the keys the mask, the
    positions and the segment ids make visible. A query with no visible key
    gets zeros (and zero gradients), unlike ``jax.nn.dot_product_attention``,
    which returns the mean of V. Statistics are float32 for every input dtype.

    Args:
      q: ``[B,T,N,H]`` queries.
      k: ``[B,S,K,H]`` keys, ``N % K == 0`` (MHA, GQA, MQA).
      v: ``[B,S,K,E]`` values.
      mask: an ``attn.masks.Mask`` on absolute positions; None is bidirectional.
      bias: additive logits, rank 4, broadcastable to ``[B,N,T,S]``.
      scale: logit scale, default ``1/sqrt(H)``.
      softcap: if given, logits become ``softcap * tanh(logits / softcap)``.
      sink_logits: ``[N]`` learned per-head logits that join the softmax
        denominator without contributing a value (learned sink logits, gpt-oss style).
      q_positions: ``[T]`` or ``[B,T]`` ints. Default ``arange(T) + S - T``: the
        queries are the last T of the keys (bottom-right alignment, so a decode
        step or a prefill chunk is right without positions). With T > S, or
        with ``kv_positions`` and T != S, a mask other than ``full()`` needs them.
      kv_positions: ``[S]`` or ``[B,S]`` ints, default ``arange(S)``.
      q_segment_ids, kv_segment_ids: ``[B,T]``, ``[B,S]`` ints; queries see only
        keys with the same id (packing and padding).
      return_weights: also return the float32 weights ``[B,N,T,S]``.
      return_lse: also return the float32 log-sum-exp ``[B,T,N]`` of the visible
        logits (and sink); ``-inf`` for a row that sees nothing.

    Returns:
      ``out [B,T,N,E]`` in q's dtype, then the weights and/or the lse if asked.
    """
    mask, scale, softcap = check_static(mask, scale, softcap)
    return _dense(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        softcap=softcap,
        sink_logits=sink_logits,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        return_weights=bool(return_weights),
        return_lse=bool(return_lse),
    )


# Jitted at the boundary so eager callers compile once per shape instead of
# dispatching op by op; inside a caller's jit it is inlined.
@functools.partial(
    jax.jit, static_argnames=("mask", "scale", "softcap", "return_weights", "return_lse")
)
def _dense(
    q,
    k,
    v,
    *,
    mask,
    bias,
    scale,
    softcap,
    sink_logits,
    q_positions,
    kv_positions,
    q_segment_ids,
    kv_segment_ids,
    return_weights,
    return_lse,
):
    c = check_call(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        softcap=softcap,
        sink_logits=sink_logits,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    B, T, S, N, K, G, H, E = c.dims
    qg = q.reshape(B, T, K, G, H)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    chex.assert_shape(s, (B, K, G, T, S))
    s = shape_logits(s, c.scale, c.softcap)
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
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    denom = p.sum(-1, keepdims=True)
    if c.sink_logits is not None:
        denom = denom + jnp.exp(c.sink_logits[None, :, :, None, None] - m)
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


def _grouped_bias(bias, d: _checks.Dims):
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
