"""Where a query's blocks lie among the keys: the layout the sparse methods share.

The sparse methods cut each sequence into blocks by position: key position
``p`` of a segment lies in block ``p // block`` of that segment, so a packed
row cuts each sequence as if it ran alone, and a decode step cuts its cache
as the forward pass cut the sequence. To find a block in the key array
without searching, the fast forms need the layout every layer produces
(contiguous caches, packed rows, paged pages gathered in order): the keys of
one segment are one run of the array, their positions consecutive
(``check_runs`` refuses anything else where the values are known).

Then the key of position ``x`` in a query's segment sits at array index
``origin + x``, with ``origin`` the index where position 0 of the run would
be (``locate``), and a block is an index range clipped to the run.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn.checks import fail
from attn.masks import PADDING, BlockKind
from attn.softmax.call import Call


class Runs(NamedTuple):
    """Per query, its segment's run of keys: ``[B,T]`` int32 array indices.

    ``origin`` is where position 0 of the run would sit (``lo - position of
    key lo``); ``lo`` and ``hi`` bound the run (``lo == hi``: no keys, as for
    a padding query); ``first`` is the position of the run's first key.
    """

    origin: jax.Array
    lo: jax.Array
    hi: jax.Array
    first: jax.Array


def check_runs(c: Call) -> None:
    """Refuses a key layout the fast forms cannot read, where its values are known.

    Each nonzero segment id must be one run of the key array, with positions
    that grow by 1 along it (without segment ids, the whole row is one run).
    Under a trace nothing is checked: the layers build their layouts this way.
    """
    rows = c.static_rows()
    if rows is None:
        return
    kv_pos = rows[1]
    kv_seg = rows[3] if len(rows) == 4 else np.ones_like(kv_pos)
    for b in range(kv_pos.shape[0]):
        ids, pos = kv_seg[b], kv_pos[b]
        same = ids[1:] == ids[:-1]
        jumps = same & (ids[1:] != PADDING) & (pos[1:] != pos[:-1] + 1)
        if jumps.any():
            s = int(np.argmax(jumps)) + 1
            fail(
                "kv_positions",
                "positions growing by 1 along each segment's run of keys "
                "(the sparse methods find blocks by position)",
                f"row {b}: position {pos[s]} after {pos[s - 1]} at key {s}",
            )
        starts = ids[np.concatenate([[True], ~same])]
        real = starts[starts != PADDING]
        if real.size != np.unique(real).size:
            fail(
                "kv_segment_ids",
                "each segment one run of keys (packed sequences one after another)",
                f"row {b}: an id in several runs",
            )


def locate(c: Call) -> Runs:
    """Each query's run of keys (``Runs``), found by binary search in the sorted key ids.

    A query whose id no key has (padding included) gets an empty run.
    """
    B, T, S = c.dims.B, c.dims.T, c.dims.S
    kv_pos = c.kv_positions
    if c.q_segment_ids is None:
        lo = jnp.zeros((B, T), jnp.int32)
        hi = jnp.full((B, T), S, jnp.int32)
    else:
        lo, hi = jax.vmap(_find_runs)(c.q_segment_ids, c.kv_segment_ids)
        hi = jnp.where(c.q_segment_ids == PADDING, lo, hi)
    first = jnp.take_along_axis(kv_pos, jnp.minimum(lo, S - 1), axis=1)
    return Runs(origin=lo - first, lo=lo, hi=hi, first=first)


def _find_runs(q_seg, kv_seg):
    """``(lo, hi)`` ``[T]``: the array range of the keys with each query's id (one run)."""
    order = jnp.argsort(kv_seg, stable=True)  # a stable sort keeps each id's keys in order
    ids = kv_seg[order]
    first = jnp.searchsorted(ids, q_seg, side="left")
    count = jnp.searchsorted(ids, q_seg, side="right") - first
    lo = order[jnp.minimum(first, kv_seg.shape[0] - 1)]
    return lo.astype(jnp.int32), (lo + count).astype(jnp.int32)


def run_starts(ids):
    """``[B,S]`` int32: the array index where each key's run of equal ids starts."""
    s = jnp.arange(ids.shape[1], dtype=jnp.int32)
    new = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
    return jax.lax.cummax(jnp.where(new, s, 0), axis=1)


def max_blocks(S: int, block: int) -> int:
    """How many blocks of ``block`` positions a run of up to S consecutive positions touches."""
    return (S + block - 2) // block + 1


class Blocks(NamedTuple):
    """A query's candidate blocks ``[B,T,J]``: block ``j`` of its run, for ``j < J``.

    ``start`` and ``stop`` bound the block's keys in the array (clipped to
    the run); ``lo_pos``/``hi_pos`` are their first and last positions;
    ``kind`` is the mask's ``BlockKind`` of the query against them (EMPTY for a
    block with no keys).
    """

    start: jax.Array
    stop: jax.Array
    lo_pos: jax.Array
    hi_pos: jax.Array
    kind: jax.Array


def blocks(mask, runs: Runs, q_pos, block: int, S: int) -> Blocks:
    """The blocks of ``block`` positions of each query's run, classified by ``mask``.

    Args:
      runs: ``Runs`` of the queries, each ``[B,C]``; q_pos: their positions ``[B,C]``.
    """
    J = max_blocks(S, block)
    origin, lo, hi = runs.origin[..., None], runs.lo[..., None], runs.hi[..., None]
    j = (runs.first // block)[..., None] + jnp.arange(J, dtype=jnp.int32)  # absolute index
    start = jnp.maximum(origin + j * block, lo)
    stop = jnp.minimum(origin + (j + 1) * block, hi)
    lo_pos, hi_pos = start - origin, stop - 1 - origin
    q = q_pos[..., None]
    kind = mask.classify(q, q, lo_pos, hi_pos)
    kind = jnp.where(stop > start, kind, int(BlockKind.EMPTY))
    return Blocks(start, stop, lo_pos, hi_pos, kind)


def own_block(runs: Runs, q_pos, block: int):
    """``[B,C]`` int32: the index ``j`` (into ``Blocks``) of the block holding each query's
    position."""
    return q_pos // block - runs.first // block


def block_tokens(start, stop, block: int):
    """Token indices ``[..., n*block]`` of the index ranges ``[start, stop)`` ``[..., n]``
    (each at most ``block`` long), and which are real (the rest read index 0)."""
    idx = start[..., None] + jnp.arange(block, dtype=jnp.int32)
    real = idx < stop[..., None]
    idx = jnp.where(real, idx, 0)
    return idx.reshape(*idx.shape[:-2], -1), real.reshape(*real.shape[:-2], -1)
