"""The Pallas kernels' block schedules, from blockwise attention's classification.

``attn.blockwise_schedule`` decides which (query block, key block) pairs a mask,
the positions, the segment ids and the padding leave EMPTY, FULL or PARTIAL;
this module reuses it unchanged and lays the answer out twice:

* ``by_query``: per query block, its non-empty key blocks in key order (the
  forward and the dq kernels loop over these), and
* ``by_key``: per key block, its non-empty query blocks (the dk/dv kernel).

Static (NumPy, as wide as the busiest block) for default or concrete positions
and segment ids; computed at run time for traced ones, where packed sequences
then skip the blocks between segments too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn._checks import default_positions
from attn.blockwise_schedule import Schedule, block_bounds, block_kinds, compact
from attn.blockwise_tiles import TileConfig
from attn.masks import BlockKind
from attn.pallas.blocks import next_power_of_2


class Schedules(NamedTuple):
    """Both layouts of one call's block schedule (int32 arrays, no gradient)."""

    by_query: Schedule  # key_tile [nq, W]: key block indices
    by_key: Schedule  # key_tile [nk, W']: query block indices


def schedules(
    config: TileConfig, rows: Sequence, given: Sequence, bwd_block_q: int, bwd_block_k: int
) -> Schedules:
    """The forward schedule (``config``'s blocks) and the dk/dv one (the backward blocks).

    Args:
      config: a ``TileConfig`` whose blocks are the forward kernel's.
      rows: ``(array, length)`` of the checked int32 q positions ``[B,T]`` and kv
        positions ``[B,S]`` and, with segment ids, of the q and kv ids.
      given: those arguments as the caller gave them (None for a default).
      bwd_block_q, bwd_block_k: the dk/dv kernel's blocks.
    """
    xp, values = _values(config, rows, given)
    by_query = _layout(xp, config, values, transpose=False)
    bwd = config._replace(block_q=bwd_block_q, block_k=bwd_block_k)
    return Schedules(by_query, _layout(xp, bwd, values, transpose=True))


def _values(config: TileConfig, rows, given):
    """NumPy arrays when every input is known at trace time, else the traced ones."""
    if any(isinstance(x, jax.core.Tracer) for x in given):
        return jnp, [x for x, _ in rows]
    offsets = [config.S - config.T, 0, 0, 0]  # default queries: the last T keys
    values = []
    for x, (_, length), offset in zip(given[: len(rows)], rows, offsets, strict=False):
        x = default_positions(length, offset) if x is None else np.asarray(x)
        values.append(np.broadcast_to(x, (config.B, length)).astype(np.int64))
    return np, values


def _layout(xp, config: TileConfig, values, transpose: bool) -> Schedule:
    blocks = [config.block_q, config.block_k] * 2
    lengths = [config.T, config.S] * 2
    bounds = [block_bounds(xp, x, n, b) for x, n, b in zip(values, lengths, blocks, strict=False)]
    kinds = block_kinds(xp, config, *bounds)  # [nq, nk]
    if transpose:
        kinds = kinds.T
    # Static: as wide as the busiest block; at run time: every block.
    width = max(int((kinds != BlockKind.EMPTY).sum(1).max()), 1) if xp is np else kinds.shape[1]
    schedule = compact(xp, kinds, width)
    # Triton tiles are powers of two; the extra entries are never visited.
    pad = next_power_of_2(width) - width
    return Schedule(
        jnp.pad(schedule.key_tile, ((0, 0), (0, pad))),
        jnp.pad(schedule.kind, ((0, 0), (0, pad))),
        schedule.count,
    )
