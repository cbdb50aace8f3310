"""The block schedule of blockwise attention: which (query block, key block) tiles to visit.

Internal to ``attn.blockwise``. Each block's position bounds (min and max over
the batch and the block, and likewise for segment ids) go through the mask's
``classify``, which marks every (query block, key block) pair EMPTY, FULL or
PARTIAL. Per query block, the non-empty key blocks are then moved to the front
in key order, so the kernels' loops visit only them and only PARTIAL pairs
evaluate the mask.

With default positions, or positions and segment ids given as concrete arrays,
the schedule is computed in NumPy when tracing (and is as wide as the busiest
query block); with traced positions or segment ids it is computed at run time,
so packed sequences skip the blocks between segments too.

(``attn.masks.block_schedule`` is the static classification for ``arange``
positions alone, without the batch, segment ids and padding handled here.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn._checks import default_positions
from attn.blockwise_tiles import TileConfig, num_blocks
from attn.masks import BlockKind


class Schedule(NamedTuple):
    """Per query tile, the non-empty key tiles in visiting order.

    ``key_tile[i, t]`` is the t-th key/value tile of query tile i and ``kind[i, t]``
    its ``BlockKind`` (FULL or PARTIAL) for ``t < count[i]``; later entries are
    unused. W is the most key blocks any query block visits (or nk at run time).
    """

    key_tile: jax.Array  # [groups*nq, W] int32
    kind: jax.Array  # [groups*nq, W] int32
    count: jax.Array  # [groups*nq] int32


def build_schedule(config: TileConfig, rows: Sequence, given: Sequence) -> Schedule:
    """The schedule of every query tile.

    Args:
      config: the call's tile configuration.
      rows: ``(array, length, block)`` of the checked int32 q positions ``[B,T]``
        and kv positions ``[B,S]`` and, with segment ids, of the q ids ``[B,T]``
        and kv ids ``[B,S]``.
      given: the four arguments as the caller gave them (None for a default),
        which tell values known when tracing from traced ones.
    """
    nq, nk = num_blocks(config.T, config.block_q), num_blocks(config.S, config.block_k)
    if not any(isinstance(x, jax.core.Tracer) for x in given):
        xp, values = np, []
        offsets = [config.S - config.T, 0, 0, 0][: len(rows)]  # default queries: the last T keys
        for x, (_, length, _), offset in zip(given[: len(rows)], rows, offsets, strict=True):
            x = default_positions(length, offset) if x is None else np.asarray(x)
            values.append(np.broadcast_to(x, (config.B, length)).astype(np.int64))
    else:  # traced positions or segment ids: the schedule is decided at run time
        xp, values = jnp, [x for x, _, _ in rows]
    bounds = [block_bounds(xp, x, n, block) for x, (_, n, block) in zip(values, rows, strict=True)]
    kinds = block_kinds(xp, config, *bounds)  # [nq, nk]
    width = max(int((kinds != BlockKind.EMPTY).sum(1).max()), 1) if xp is np else nk
    return _for_groups(config, compact(xp, kinds, width), nq, nk)


def block_bounds(xp, x, length: int, block: int):
    """``[B, L]`` -> per block (lo ``[nb]``, hi ``[nb]``), over the batch and the block."""
    pad = num_blocks(length, block) * block - length
    x = xp.pad(x, ((0, 0), (0, pad)), mode="edge").reshape(x.shape[0], -1, block)
    return x.min(axis=(0, 2)), x.max(axis=(0, 2))


def block_kinds(xp, config: TileConfig, q_b, k_b, q_seg_b=None, k_seg_b=None):
    """``[nq, nk]`` ``BlockKind`` of every block pair from per-block (lo, hi) bounds."""
    (q_lo, q_hi), (k_lo, k_hi) = q_b, k_b
    nq, nk = q_lo.shape[0], k_lo.shape[0]
    kinds = config.mask.classify(q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :])
    kinds = xp.broadcast_to(xp.asarray(kinds, dtype=xp.int32), (nq, nk))
    empty, full = kinds == BlockKind.EMPTY, kinds == BlockKind.FULL
    if config.has_segments:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg_b, k_seg_b
        qs_lo, qs_hi, ks_lo, ks_hi = qs_lo[:, None], qs_hi[:, None], ks_lo[None, :], ks_hi[None, :]
        # Disjoint id ranges share no id; one id on both sides matches everywhere.
        empty = empty | (qs_hi < ks_lo) | (ks_hi < qs_lo)
        full = full & (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
    if config.S % config.block_k:  # the last key block holds padding, which must be masked
        full = full & (xp.arange(nk) < nk - 1)[None, :]
    return xp.where(empty, BlockKind.EMPTY, xp.where(full, BlockKind.FULL, BlockKind.PARTIAL))


def compact(xp, kinds, width: int) -> Schedule:
    """Moves each query block's non-empty key blocks to the front, in key order.

    Returns the schedule of the first head group, whose key tiles are the key blocks.
    """
    nonempty = kinds != BlockKind.EMPTY
    if xp is np:
        order = np.argsort(~nonempty, axis=1, kind="stable")
    else:
        order = jnp.argsort(~nonempty, axis=1, stable=True)
    key_block = order[:, :width]
    kind = xp.take_along_axis(kinds, key_block, axis=1)
    count = nonempty.sum(1)
    return Schedule(
        jnp.asarray(key_block, jnp.int32),
        jnp.asarray(kind, jnp.int32),
        jnp.asarray(count, jnp.int32),
    )


def _for_groups(config: TileConfig, blocks: Schedule, nq: int, nk: int) -> Schedule:
    """Repeats the schedule of the query blocks for each head group's tiles.

    Head group g's key tiles are ``g*nk + j``, so its key block indices are offset by ``g*nk``.
    """
    offsets = jnp.arange(config.groups, dtype=jnp.int32)[:, None, None] * nk
    key_tile = (offsets + blocks.key_tile[None]).reshape(config.groups * nq, -1)
    kind = jnp.tile(blocks.kind, (config.groups, 1))
    return Schedule(key_tile, kind, jnp.tile(blocks.count, config.groups))
