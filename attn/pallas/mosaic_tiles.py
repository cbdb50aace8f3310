"""The tile math of the Mosaic GPU flash attention, shared by its Hopper kernel and its twin.

Both kernels (``attn.pallas.mosaic``) hold one query block's float32 online
softmax and differ only in how a tile reaches it: the Hopper kernel's tiles
come through TMA into shared memory and ``wgmma``, the twin's through ref
slices and ``jnp.dot`` (what Pallas's Mosaic GPU interpreter runs on a CPU).
Everything between the product ``q k^T`` of a tile and its ``P`` is here, in
operations both lower: full-shape broadcasts (``lax.broadcast_in_dim``, never
``x[:, None]``, which a register layout cannot take), selects and ``exp2``.

The softmax runs in base 2: the logits are scaled by ``log2(e)`` once per
tile, so each ``exp`` is an ``exp2``; the lse leaves in natural log.
Statistics start at ``MASKED``, a finite floor, so a row that has seen
nothing yet adds nothing and a row that sees nothing ends with ``l = 0``
(output 0, lse ``-inf``) without a NaN.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from attn import masks
from attn.pallas.common import allowed_pairs
from attn.softmax.call import MASKED, CallSpec

LOG2E = math.log2(math.e)


def along(x, shape, axis: int):
    """A row vector (``axis`` 0: one value per query) or column vector (1: per key) of a
    tile, broadcast to the tile's ``shape``."""
    return lax.broadcast_in_dim(x, shape, [axis])


def scores(call: CallSpec, qk, kind, q_pos, k_pos, q_seg=None, k_seg=None):
    """A tile's logits in base 2, masked unless the schedule says FULL.

    Args:
      call: the call's static part (scale, soft-cap, mask).
      qk: float32 ``[Q, J]``, the tile's ``q k^T``.
      kind: the tile's ``attn.masks.BlockKind`` (int32 scalar): FULL tiles skip the mask.
      q_pos, k_pos: int32 ``[Q, J]``, the tile's positions (``along``).
      q_seg, k_seg: int32 ``[Q, J]`` segment ids (id 0: padding), or None.

    Returns:
      float32 ``[Q, J]``: ``log2(e) * softcap(scale * qk)`` where the pair is visible,
      ``MASKED`` where not.
    """
    if call.softcap is None:
        s = qk * (call.scale * LOG2E)
    else:
        cap = call.softcap
        s = jnp.tanh(qk * (call.scale / cap)) * (cap * LOG2E)

    def masked(s):
        ok = allowed_pairs(call.mask, q_pos, k_pos)
        if q_seg is not None:
            ok = ok & (q_seg == k_seg) & (k_seg != masks.PADDING)
        return jnp.where(ok, s, MASKED)

    return lax.cond(kind == masks.BlockKind.FULL, lambda s: s, masked, s)


def start(call: CallSpec, rows: int, sink=None):
    """``(m, l)`` of a query block before its first tile: ``MASKED`` and 0, or with a
    sink logit (natural units) the sink as one more logit with no value."""
    if sink is None:
        return jnp.full((rows,), MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32)
    return jnp.full((rows,), sink * LOG2E, jnp.float32), jnp.ones((rows,), jnp.float32)


def online(m, l, s):
    """One tile into the running max ``m`` and sum ``l`` (``[Q]``) of base-2 logits ``s``.

    Returns:
      ``(m, l, alpha, p)``: the new statistics, the factor ``[Q]`` that rescales the
      accumulator, and the tile's float32 probabilities ``[Q, J]`` (unnormalised).
    """
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    # A row that has seen nothing yet (its max still MASKED) adds nothing: subtracting
    # +inf makes its p exactly 0.
    p = jnp.exp2(s - along(jnp.where(m_new > MASKED, m_new, jnp.inf), s.shape, 0))
    return m_new, alpha * l + p.sum(axis=1), alpha, p


def finish(acc, m, l):
    """``(out, lse)`` of a query block: ``acc / l`` (0 where the row saw nothing) and the
    natural-log lse ``[Q]`` (``-inf`` there)."""
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    out = acc / along(safe, acc.shape, 0)
    return out, jnp.where(seen, (m + jnp.log2(safe)) / LOG2E, -jnp.inf)


def probabilities(s, lse):
    """A tile's ``P`` from its base-2 logits and its rows' base-2 lse (both full-shape;
    an lse of ``+inf``, a row that sees nothing or padding, gives ``P = 0``)."""
    return jnp.exp2(s - lse)


def logit_grads(call: CallSpec, qk, p, dp, delta):
    """The cotangent of a tile's ``q k^T`` over the scale (the kernels multiply their
    accumulated dq and dk by it once).

    Args:
      qk: float32 ``[Q, J]`` (or its transpose: every argument is elementwise).
      p: the tile's probabilities; dp: ``dO V^T`` on the tile.
      delta: full-shape ``rowsum(dO * O) - d_lse`` of each query.

    Returns:
      ``P * (dP - delta)``, through the soft-cap's derivative where there is one.
    """
    dx = p * (dp - delta)
    if call.softcap is None:
        return dx
    t = jnp.tanh(qk * (call.scale / call.softcap))
    return dx * (1.0 - t * t)
