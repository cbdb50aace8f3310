"""The Pallas kernels' block schedules, from the shared block classification.

``attn.softmax.schedule`` decides which (query block, key block) pairs a mask,
the positions, the segment ids and the padding leave EMPTY, FULL or PARTIAL;
this module reuses it unchanged on the kernels' two ``BlockSpec`` (the
forward's and the dk/dv kernel's blocks of a ``FlashConfig``) and lays the
answer out twice:

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

import jax.numpy as jnp

from attn.pallas.blocks import next_power_of_2
from attn.pallas.common import FlashConfig
from attn.softmax.schedule import BlockSpec, Schedule, block_kind_table, compact


class Schedules(NamedTuple):
    """Both layouts of one call's block schedule (int32 arrays, no gradient)."""

    by_query: Schedule  # key_tile [nq, W]: key block indices
    by_key: Schedule  # key_tile [nk, W']: query block indices


def schedules(config: FlashConfig, rows: Sequence, static: Sequence | None,
              keep=None) -> Schedules:  # fmt: skip
    """The forward schedule (``config``'s blocks) and the dk/dv one (its backward blocks).

    Args:
      config: the call's kernel settings.
      rows: the checked int32 q positions ``[B,T]`` and kv positions ``[B,S]``
        and, with segment ids, the q and kv ids.
      static: the same in NumPy when known at trace time
        (``attn.softmax.call.Call.static_rows``), or None.
      keep: the call's boolean mask array, or None.
    """
    by_query = _layout(config.blocks, rows, static, keep, transpose=False)
    return Schedules(by_query, _layout(config.bwd_blocks, rows, static, keep, transpose=True))


def _layout(blocks: BlockSpec, rows, static, keep, transpose: bool) -> Schedule:
    xp, kinds = block_kind_table(blocks, rows, static, keep)  # [nq, nk]
    schedule = compact(xp, kinds.T if transpose else kinds)
    # Triton tiles are powers of two; the extra entries are never visited.
    width = schedule.key_tile.shape[1]
    pad = next_power_of_2(width) - width
    return Schedule(
        jnp.pad(schedule.key_tile, ((0, 0), (0, pad))),
        jnp.pad(schedule.kind, ((0, 0), (0, pad))),
        schedule.count,
    )
