"""Layouts of a sequence over the devices of a ring, and the tile sizes that suit them.

A layout is the order in which a sequence's positions are laid out over the
P devices of a mesh axis: device i holds ``order[i*L : (i+1)*L]`` (L = length
/ P). ``"contiguous"`` keeps the sequence in order; ``"zigzag"`` (also called
dual-chunk swap) cuts it into 2P chunks and gives device i chunks i and
``2P - 1 - i``, so that under a causal mask every device holds one early and
one late chunk and does the same work (``attn.ring.work`` counts it).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attn import checks
from attn.checks import fail
from attn.softmax.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

__all__ = ["LAYOUTS", "default_blocks", "from_layout", "layout_order", "to_layout", "zigzag_order"]

LAYOUTS = ("contiguous", "zigzag")


def layout_order(length: int, num_devices: int, layout: str = "zigzag") -> np.ndarray:
    """The sequence indices in layout order: device i holds ``order[i*L : (i+1)*L]``, L = length/P.

    ``"contiguous"``: ``arange(length)``. ``"zigzag"``: the sequence in ``2P``
    chunks, device i holding chunks i and ``2P - 1 - i`` (``zigzag_order``).
    """
    if layout not in LAYOUTS:
        fail("layout", f"one of {LAYOUTS}", repr(layout))
    num_devices = checks.positive_int(num_devices, "num_devices")
    if layout == "zigzag":
        return zigzag_order(length, num_devices)
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
        fail("length", "a positive int", repr(length))
    if length % num_devices:
        fail("length", f"a multiple of the {num_devices} devices (contiguous layout)", length)
    return np.arange(length)


def zigzag_order(length: int, num_devices: int) -> np.ndarray:
    """Indices of the zigzag (dual-chunk swap) layout, ``[length]``.

    The sequence is cut into ``2P`` chunks of ``length / 2P``; device i holds
    chunk i followed by chunk ``2P - 1 - i``. E.g. length 8 on 2 devices:
    ``[0 1 6 7 | 2 3 4 5]``.
    """
    num_devices = checks.positive_int(num_devices, "num_devices")
    length = checks.positive_int(length, "length")
    chunks = 2 * num_devices
    if length % chunks:
        fail("length", f"a multiple of 2 x {num_devices} devices (zigzag layout)", length)
    c = length // chunks
    order = [(i, chunks - 1 - i) for i in range(num_devices)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for pair in order for j in pair])


def to_layout(x, num_devices: int, layout: str = "zigzag", axis: int = 1):
    """Reorders the sequence axis of ``x`` (e.g. ``[B,T,...]``) into the layout."""
    x = jnp.asarray(x)
    return jnp.take(x, layout_order(x.shape[axis], num_devices, layout), axis=axis)


def from_layout(x, num_devices: int, layout: str = "zigzag", axis: int = 1):
    """Inverse of ``to_layout``: the sequence axis back in its original order."""
    x = jnp.asarray(x)
    order = layout_order(x.shape[axis], num_devices, layout)
    return jnp.take(x, np.argsort(order), axis=axis)


def default_blocks(layout: str, T: int, S: int, block_q, block_k) -> tuple[int, int]:
    """Tile sizes for a layout's shards of T queries and S keys (given sizes are kept).

    A zigzag shard is two chunks far apart in the sequence; a tile that spans
    both covers early and late positions and is non-empty against almost every
    key block, which undoes the balance. Default tiles stop at the chunk length.
    """
    cap_q, cap_k = (T // 2, S // 2) if layout == "zigzag" else (T, S)
    block_q = min(DEFAULT_BLOCK_Q, cap_q) if block_q is None else block_q
    block_k = min(DEFAULT_BLOCK_K, cap_k) if block_k is None else block_k
    return block_q, block_k
