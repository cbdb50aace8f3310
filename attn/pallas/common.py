"""What the Pallas kernels share: the call's static configuration, its integer inputs,
the launch settings and the tile mask.

Internal to ``attn.pallas``. Arrays keep the project's layouts, padded to whole
blocks: q ``[B,Tp,N,H]``, k ``[B,Sp,K,H]``, v ``[B,Sp,K,E]``, out like q with E,
lse and the backward's row statistics ``[B,N,Tp]`` float32, positions and
segment ids ``[B,Tp]`` / ``[B,Sp]`` int32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attn import masks
from attn.softmax.call import MASKED, shape_logits
from attn.softmax.schedule import BlockSpec, Schedule


@dataclasses.dataclass(frozen=True)
class FlashConfig(BlockSpec):
    """Hashable settings of one call: a static argument of the custom VJP.

    The inherited ``T`` and ``S`` are the real lengths (the arrays are padded
    past them) and ``block_q``/``block_k`` the forward and dq kernels' tiles,
    which the forward schedule is laid out in.
    """

    bwd_block_q: int  # dk/dv kernel: query rows per inner-loop step
    bwd_block_k: int  # dk/dv kernel: keys per program
    interpret: bool
    num_warps: int | None
    num_stages: int | None


class KernelInts(NamedTuple):
    """The integer inputs of the kernels; no gradient flows to them."""

    by_query: Schedule  # forward and dq: key blocks per query block
    by_key: Schedule  # dk/dv: query blocks per key block
    q_pos: jax.Array  # [B,Tp] int32
    kv_pos: jax.Array  # [B,Sp] int32
    q_seg: jax.Array | None  # [B,Tp] int32
    kv_seg: jax.Array | None  # [B,Sp] int32


def compiler_params(config: FlashConfig):
    """Triton launch settings on a GPU; nothing elsewhere."""
    if config.interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as plgpu  # loads Triton's lowering: GPU only

    return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


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
        ok = ok & masks.same_segment(q_seg, k_seg)
    J = k_pos.shape[0]
    if config.S % J:  # the last key block holds padding
        index = k_start + lax.broadcasted_iota(jnp.int32, (1, J), 1)
        ok = ok & (index < config.S)
    return ok


def logits(config: FlashConfig, q, k):
    """Float32 ``cap(scale * q k^T)`` of a tile ``[Q,H] x [J,H] -> [Q,J]``."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return shape_logits(s, config.scale, config.softcap)


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
