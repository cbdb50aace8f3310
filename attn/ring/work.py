"""Work per device of ring attention, from the masks' block classification (no timing).

``ring_work`` replays the schedule of ``attn.ring.ring_attention`` in NumPy:
which ring steps each device computes and how many FULL and PARTIAL tiles
they hold, for a layout of the sequence. ``python -m attn.ring.work [T] [P]``
prints the causal table, contiguous against zigzag, for a few block sizes.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

from attn import checks
from attn.masks import BlockKind, Mask, causal
from attn.ring.layouts import LAYOUTS, default_blocks, layout_order
from attn.softmax.schedule import num_blocks


class RingWork(NamedTuple):
    """Per device, ``[P]`` ints: what ``ring_attention`` computes there."""

    steps: np.ndarray  # ring steps computed (P minus the skipped ones)
    full: np.ndarray  # FULL tiles (query block x key block pairs, mask not evaluated)
    partial: np.ndarray  # PARTIAL tiles (mask evaluated)

    @property
    def tiles(self) -> np.ndarray:
        """Non-empty tiles computed on each device."""
        return self.full + self.partial


def ring_work(
    mask: Mask,
    length: int,
    num_devices: int,
    *,
    layout: str = "zigzag",
    block_q: int | None = None,
    block_k: int | None = None,
) -> RingWork:
    """Tiles each device computes in ring self-attention over ``length`` positions.

    Replays the ring's schedule in NumPy from ``Mask.classify``: a step counts
    when the box of the two shards' positions is not EMPTY, and then each of its
    (query block, key block) tiles counts as FULL or PARTIAL (the last key block
    of a shard holding padding is never FULL). Default blocks as in
    ``attn.ring.sharded_attention``. It matches what ``attn.ring.count_ring_tiles``
    counts at run time.
    """
    order = layout_order(length, num_devices, layout)
    L = length // num_devices
    block_q, block_k = default_blocks(layout, L, L, block_q, block_k)
    # As attn.softmax.tiles.tile_config: a block longer than the shard only adds padding.
    block_q = min(checks.positive_int(block_q, "block_q"), L)
    block_k = min(checks.positive_int(block_k, "block_k"), L)
    shards = order.reshape(num_devices, L)
    steps, full, partial = (np.zeros(num_devices, np.int64) for _ in range(3))
    for i in range(num_devices):
        for s in range(num_devices):
            q, kv = shards[i], shards[(i - s) % num_devices]
            box = (int(q.min()), int(q.max()), int(kv.min()), int(kv.max()))
            if mask.classify(*box) == BlockKind.EMPTY:
                continue
            kinds = _tile_kinds(mask, q, kv, block_q, block_k)
            steps[i] += 1
            full[i] += int((kinds == BlockKind.FULL).sum())
            partial[i] += int((kinds == BlockKind.PARTIAL).sum())
    return RingWork(steps, full, partial)


def _tile_kinds(mask: Mask, q_pos, kv_pos, block_q: int, block_k: int) -> np.ndarray:
    """``[nq, nk]`` ``BlockKind`` of one step's tiles, as the blockwise schedule finds them."""

    def bounds(x, block):  # padding repeats the last position, as attn.softmax.tiles does
        pad = num_blocks(x.size, block) * block - x.size
        x = np.pad(x, (0, pad), mode="edge").reshape(-1, block)
        return x.min(1), x.max(1)

    (q_lo, q_hi), (k_lo, k_hi) = bounds(q_pos, block_q), bounds(kv_pos, block_k)
    kinds = mask.classify(q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :])
    kinds = np.broadcast_to(np.asarray(kinds), (q_lo.size, k_lo.size)).copy()
    if kv_pos.size % block_k:  # the last key block holds padding, which must be masked
        last = kinds[:, -1]
        kinds[:, -1] = np.where(last == BlockKind.FULL, BlockKind.PARTIAL, last)
    return kinds


def work_table(length: int = 4096, num_devices: int = 8, blocks=(512, 256, 128)) -> str:
    """Markdown table of causal ``ring_work`` per device, contiguous vs zigzag, per block size."""
    lines = [
        f"Causal ring self-attention, T={length} on {num_devices} devices: non-empty tiles "
        "(FULL + PARTIAL) per device; tiles are block x block.",
        "",
        "| block | layout | "
        + " | ".join(f"dev {i}" for i in range(num_devices))
        + " | max/mean |",
        "|---|---|" + "---|" * num_devices + "---|",
    ]
    for block in blocks:
        for layout in LAYOUTS:
            work = ring_work(
                causal(), length, num_devices, layout=layout, block_q=block, block_k=block
            )
            tiles = work.tiles
            cells = " | ".join(str(int(t)) for t in tiles)
            lines.append(f"| {block} | {layout} | {cells} | {tiles.max() / tiles.mean():.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m attn.ring.work [T] [devices]
    print(work_table(*(int(a) for a in sys.argv[1:3])))
