"""Block schedules: which (query block, key block) pairs a call must visit, and how.

The tiling layer of every fused softmax implementation (blockwise, ring and
the Pallas kernels). A ``BlockSpec`` is a call cut into blocks of ``block_q``
query and ``block_k`` key positions. Each block's position bounds (min and
max over the batch and the block, and likewise for segment ids) go through
the mask's ``classify``, which marks every pair EMPTY, FULL or PARTIAL
(``block_kinds``); ``compact`` then moves each query block's non-empty key
blocks to the front in key order, so a kernel's loop visits only them and
only PARTIAL pairs evaluate the mask.

With default positions, or positions and segment ids given as concrete arrays
(``attn.softmax.call.Call.static_rows``), the schedule is computed in NumPy when
tracing (and is as wide as the busiest query block); with traced ones it is
computed at run time, so packed sequences skip the blocks between segments too.

(``attn.masks.block_schedule`` is the static classification for ``arange``
positions alone, without the batch, segment ids and padding handled here.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn.masks import PADDING, BlockKind
from attn.softmax import pairs
from attn.softmax.call import CallSpec


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """A call cut into blocks: ``block_q`` query positions by ``block_k`` key positions."""

    call: CallSpec
    block_q: int
    block_k: int


class Schedule(NamedTuple):
    """Per query block (tile), the non-empty key blocks (tiles) in visiting order.

    ``key_tile[i, t]`` is the t-th key block of query block i and ``kind[i, t]``
    its ``BlockKind`` (FULL or PARTIAL) for ``t < count[i]``; later entries are
    unused. W is the most key blocks any query block visits (or nk at run time).
    """

    key_tile: jax.Array  # [nq, W] int32
    kind: jax.Array  # [nq, W] int32
    count: jax.Array  # [nq] int32


def num_blocks(length: int, block: int) -> int:
    """Blocks of ``block`` positions that cover ``length`` (the last may hold padding)."""
    return -(-length // block)


def build_schedule(spec: BlockSpec, rows: Sequence, static: Sequence | None, keep=None) -> Schedule:
    """The schedule of every query block.

    Args:
      spec: the call's blocks.
      rows: the checked int32 q positions ``[B,T]`` and kv positions ``[B,S]``
        and, with segment ids, the q ids ``[B,T]`` and kv ids ``[B,S]``.
      static: the same in NumPy when known at trace time
        (``attn.softmax.call.Call.static_rows``), or None: computed at run time.
      keep: the call's boolean mask array (``attn.softmax.pairs``), or None: a
        block it hides entirely is EMPTY, one it hides in part is PARTIAL.
    """
    return compact(*block_kind_table(spec, rows, static, keep))


def block_kind_table(spec: BlockSpec, rows: Sequence, static: Sequence | None, keep=None):
    """``(xp, [nq, nk] BlockKind)``: NumPy when all is known at trace time, else jax.numpy."""
    xp, values = (jnp, rows) if static is None else (np, static)
    lengths, blocks = (spec.call.T, spec.call.S) * 2, (spec.block_q, spec.block_k) * 2
    bounds = [block_bounds(xp, x, n, b) for x, n, b in zip(values, lengths, blocks, strict=False)]
    kinds = block_kinds(xp, spec, *bounds)
    if keep is None:
        return xp, kinds
    keep_xp, some, every = pairs.block_any_all(keep, spec.call.T, spec.call.S, *blocks[:2])
    xp = jnp if jnp in (xp, keep_xp) else np
    kinds = xp.where(every | (kinds != BlockKind.FULL), kinds, BlockKind.PARTIAL)
    return xp, xp.where(some, kinds, BlockKind.EMPTY)


def block_bounds(xp, x, length: int, block: int):
    """``[B, L]`` -> per block (lo ``[nb]``, hi ``[nb]``), over the batch and the block."""
    pad = num_blocks(length, block) * block - length
    x = xp.pad(x, ((0, 0), (0, pad)), mode="edge").reshape(x.shape[0], -1, block)
    return x.min(axis=(0, 2)), x.max(axis=(0, 2))


def block_kinds(xp, spec: BlockSpec, q_b, k_b, q_seg_b=None, k_seg_b=None):
    """``[nq, nk]`` ``BlockKind`` of every block pair from per-block (lo, hi) bounds."""
    (q_lo, q_hi), (k_lo, k_hi) = q_b, k_b
    nq, nk = q_lo.shape[0], k_lo.shape[0]
    kinds = spec.call.mask.classify(q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :])
    kinds = xp.broadcast_to(xp.asarray(kinds, dtype=xp.int32), (nq, nk))
    empty, full = kinds == BlockKind.EMPTY, kinds == BlockKind.FULL
    if spec.call.has_segments:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg_b, k_seg_b
        qs_lo, qs_hi, ks_lo, ks_hi = qs_lo[:, None], qs_hi[:, None], ks_lo[None, :], ks_hi[None, :]
        # Disjoint id ranges share no id; a block of padding alone sees, or is seen by, nothing.
        q_pad, k_pad = (qs_lo == qs_hi) & (qs_lo == PADDING), (ks_lo == ks_hi) & (ks_lo == PADDING)
        empty = empty | (qs_hi < ks_lo) | (ks_hi < qs_lo) | q_pad | k_pad
        # One id, not padding, on both sides matches everywhere.
        full = full & (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo) & (qs_lo != PADDING)
    if spec.call.S % spec.block_k:  # the last key block holds padding, which must be masked
        full = full & (xp.arange(nk) < nk - 1)[None, :]
    return xp.where(empty, BlockKind.EMPTY, xp.where(full, BlockKind.FULL, BlockKind.PARTIAL))


def compact(xp, kinds) -> Schedule:
    """Moves each row's non-empty blocks of ``kinds [n, m]`` to the front, in order.

    Static (NumPy): as wide as the busiest row; at run time: all m blocks.
    """
    nonempty = kinds != BlockKind.EMPTY
    if xp is np:
        width = max(int(nonempty.sum(1).max()), 1)
        order = np.argsort(~nonempty, axis=1, kind="stable")
    else:
        width = kinds.shape[1]
        order = jnp.argsort(~nonempty, axis=1, stable=True)
    key_block = order[:, :width]
    kind = xp.take_along_axis(kinds, key_block, axis=1)
    count = nonempty.sum(1)
    return Schedule(
        jnp.asarray(key_block, jnp.int32),
        jnp.asarray(kind, jnp.int32),
        jnp.asarray(count, jnp.int32),
    )
