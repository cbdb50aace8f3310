"""What the Pallas kernels share: the call's static configuration and the tile mask.

Internal to ``attn.pallas``. Arrays keep the project's layouts, padded to whole
blocks: q ``[B,Tp,N,H]``, k ``[B,Sp,K,H]``, v ``[B,Sp,K,E]``, out like q with E,
lse and the backward's row statistics ``[B,N,Tp]`` float32, positions and
segment ids ``[B,Tp]`` / ``[B,Sp]`` int32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from attn import masks
from attn.dense import MASKED


class FlashConfig(NamedTuple):
    """Hashable settings of one call: a static argument of the custom VJP."""

    mask: masks.Mask
    scale: float
    softcap: float | None
    has_sink: bool
    has_segments: bool
    T: int  # real lengths; the arrays are padded past them
    S: int
    G: int  # query heads per kv head
    block_q: int
    block_k: int
    bwd_block_q: int
    bwd_block_k: int
    interpret: bool
    num_warps: int | None
    num_stages: int | None


def allowed(mask: masks.Mask, q_pos, k_pos):
    """The mask on a tile: boolean ``[Q, J]`` from positions ``[Q]`` and ``[J]``.

    The algebra's own jnp code, except that global tokens are compared one
    position at a time: their generic rule builds a ``[Q, J, P]`` array, whose
    size Triton would need to be a power of two.
    """
    match mask:
        case masks.And(a, b):
            return allowed(a, q_pos, k_pos) & allowed(b, q_pos, k_pos)
        case masks.Or(a, b):
            return allowed(a, q_pos, k_pos) | allowed(b, q_pos, k_pos)
        case masks.GlobalTokens(positions):
            q, k = q_pos[:, None], k_pos[None, :]
            hits = [(q == p) | (k == p) for p in positions]
            return functools.reduce(jnp.logical_or, hits)
    return mask.allowed(q_pos, k_pos)


def tile_visible(config: FlashConfig, q_pos, k_pos, k_start, q_seg=None, k_seg=None):
    """Boolean ``[Q, J]``: mask, segment ids, and (where S is padded) the real keys."""
    ok = allowed(config.mask, q_pos, k_pos)
    if q_seg is not None:
        ok = ok & (q_seg[:, None] == k_seg[None, :])
    J = k_pos.shape[0]
    if config.S % J:  # the last key block holds padding
        index = k_start + lax.broadcasted_iota(jnp.int32, (1, J), 1)
        ok = ok & (index < config.S)
    return ok


def logits(config: FlashConfig, q, k):
    """Float32 ``cap(scale * q k^T)`` of a tile ``[Q,H] x [J,H] -> [Q,J]``."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * config.scale
    if config.softcap is not None:
        s = config.softcap * jnp.tanh(s / config.softcap)
    return s


def masked_unless_full(config: FlashConfig, s, kind, visible):
    """``s`` with invisible entries at ``MASKED``; FULL tiles never evaluate the mask."""
    return lax.cond(
        kind == masks.BlockKind.FULL,
        lambda s: s,
        lambda s: jnp.where(visible(), s, MASKED),
        s,
    )


def matmul(a, b, contract=(1, 0)):
    """2-D float32-accumulated product contracting ``a``'s and ``b``'s given axes."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
