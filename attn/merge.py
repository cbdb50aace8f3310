"""Merging partial softmax-attention results computed over disjoint key sets.

Softmax attention over keys ``S = S_a + S_b`` (disjoint) is a weighted mix of the
attention over ``S_a`` and over ``S_b``: with the log-sum-exps ``lse_a`` and
``lse_b`` of the two parts' logits,

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

This is the one merge primitive of the project: blockwise attention applies it
(in its unnormalized form, ``merge_unnormalized``) after every key block,
ring attention after every shard, split decoding after every split. A part
that sees no key has ``lse = -inf`` and weight zero; no NaN arises even when
every part is empty (the result is zeros with ``lse = -inf``, like a fully
masked row of ``attn.dot_product_attention``).
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import jax.numpy as jnp

from attn.checks import fail


def merge_unnormalized(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Merges two unnormalized softmax partials ``(max, sum, weighted values)``.

    A partial over keys ``s`` is ``m = max_s x_s``, ``l = sum_s exp(x_s - m)`` and
    ``acc = sum_s exp(x_s - m) v_s``; its attention output is ``acc / l`` and its
    log-sum-exp ``m + log(l)``. Maxima may be ``-inf`` or a large negative
    sentinel (``attn.softmax.call.MASKED``) for parts with no visible key.

    Args:
      m_a, l_a: float32 arrays of one shape X (e.g. ``[B,K,G,C]``, one per query row).
      acc_a: float32 ``X + [E]``.
      m_b, l_b, acc_b: the other part, same shapes.

    Returns:
      ``(m, l, acc)`` of the union of the two key sets, same shapes.
    """
    chex.assert_equal_shape([m_a, l_a, m_b, l_b])
    chex.assert_equal_shape([acc_a, acc_b])
    chex.assert_equal_shape_prefix([m_a, acc_a], m_a.ndim)
    m = jnp.maximum(m_a, m_b)
    # Where both parts are empty (m = -inf) any finite reference works: l is 0.
    ref = jnp.where(jnp.isneginf(m), 0.0, m)
    scale_a, scale_b = jnp.exp(m_a - ref), jnp.exp(m_b - ref)
    l = l_a * scale_a + l_b * scale_b
    acc = acc_a * scale_a[..., None] + acc_b * scale_b[..., None]
    return m, l, acc


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Exact attention over the union of two disjoint key sets from the two partials.

    Args:
      out_a: ``[B,T,N,E]`` attention output over the first key set (any float dtype).
      lse_a: ``[B,T,N]`` its log-sum-exp, ``-inf`` for rows that see none of its keys.
      out_b, lse_b: the same over the second key set.

    Returns:
      ``(out [B,T,N,E] in out_a's dtype, lse [B,T,N] float32)``, equal to one
      attention call over both key sets (``return_lse=True``).
    """
    return merge_partials((out_a, out_b), (lse_a, lse_b))


def merge_partials(outs: Sequence, lses: Sequence):
    """Exact attention over the union of ``P`` disjoint key sets from their partials.

    Args:
      outs: ``P`` arrays ``[B,T,N,E]`` (or one stacked ``[P,B,T,N,E]``).
      lses: ``P`` float arrays ``[B,T,N]`` (or one stacked ``[P,B,T,N]``), ``-inf``
        where a part sees no key.

    Returns:
      ``(out [B,T,N,E] in the outputs' dtype, lse [B,T,N] float32)``; rows that see
      no key in any part give zeros and ``lse = -inf`` (and no NaN in gradients).
    """
    outs, lses = _stacked(outs, "outs"), _stacked(lses, "lses")
    if outs.shape[:-1] != lses.shape:
        fail("lses", f"shape {outs.shape[:-1]} to match outs {outs.shape}", lses.shape)
    dtype = outs.dtype
    lses = lses.astype(jnp.float32)
    m = lses.max(0)
    ref = jnp.where(jnp.isneginf(m), 0.0, m)  # all parts empty: weights are all zero
    w = jnp.exp(lses - ref)  # [P,B,T,N], 0 for empty parts
    total = w.sum(0)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    out = (w[..., None] * outs.astype(jnp.float32)).sum(0) / safe_total[..., None]
    lse = jnp.where(seen, ref + jnp.log(safe_total), -jnp.inf)
    return out.astype(dtype), lse


def _stacked(xs, name):
    if isinstance(xs, Sequence):
        if not xs:
            fail(name, "at least one partial result", "an empty sequence")
        shapes = {jnp.shape(x) for x in xs}
        if len(shapes) != 1:
            fail(name, "partials of one shape", sorted(shapes))
        return jnp.stack([jnp.asarray(x) for x in xs])
    xs = jnp.asarray(xs)
    if xs.ndim < 2:
        fail(name, "a sequence of partials or a stacked array [P, ...]", f"shape {xs.shape}")
    return xs
