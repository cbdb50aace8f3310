"""Ring attention (Liu, Zaharia and Abbeel, 2023): softmax attention over a sequence sharded
on one mesh axis, with K/V passed around the ring instead of gathered.

Modules:

* ``attention``: ``ring_attention``, called inside ``jax.shard_map`` on each
  device's shard, and ``count_ring_tiles``;
* ``kernels``: the ring's loop over the visiting k/v blocks and its custom VJP
  (the blockwise kernels of ``attn.softmax`` at every step);
* ``layouts``: how a sequence is laid out over the devices (contiguous,
  zigzag) and the tile sizes that suit each layout;
* ``sharded``: ``sharded_attention``, the same on whole arrays over a mesh;
* ``work``: the tiles each device computes, from the masks' classification
  (``python -m attn.ring.work [T] [P]`` prints the causal table; not imported
  here, so that it runs as a module without being imported twice).
"""

from attn.ring.attention import count_ring_tiles, ring_attention
from attn.ring.layouts import (
    LAYOUTS,
    default_blocks,
    from_layout,
    layout_order,
    to_layout,
    zigzag_order,
)
from attn.ring.sharded import sharded_attention

__all__ = [
    "LAYOUTS",
    "count_ring_tiles",
    "default_blocks",
    "from_layout",
    "layout_order",
    "ring_attention",
    "sharded_attention",
    "to_layout",
    "zigzag_order",
]
