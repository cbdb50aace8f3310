"""Arrays over query-key pairs: a bias and a boolean mask, as ``jax.nn`` takes them.

Internal to ``attn.softmax`` (and the Pallas kernels). A call may carry

* ``bias``: additive logits, broadcastable to ``[B,N,T,S]``, added after the
  score modifier; it gets gradients;
* ``keep``: a boolean array broadcastable to ``[B,N,T,S]``; False hides the
  key from the query, as the mask, the positions and the segment ids do.

Both are stored as given, made rank 4 (leading unit axes, as ``jax.nn`` adds
them), and never broadcast in memory: an implementation reads the tile it
needs (``grouped`` for dense attention, ``tile`` for blockwise tiles, block
specs in the Pallas kernels), and the block schedule reads ``keep`` per block
(``block_any_all``), so a block whose tile of ``keep`` is all False is skipped
like a block the mask hides.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from attn.checks import Dims, concrete, fail


def num_blocks(length: int, block: int) -> int:
    """Blocks of ``block`` positions that cover ``length``."""
    return -(-length // block)


def check_pair(x, name: str, d: Dims, boolean: bool):
    """``x`` as a rank-4 array broadcastable to ``[B,N,T,S]``, or a ``ValueError``."""
    want = f"({d.B}, {d.N}, {d.T}, {d.S})"
    what = "a boolean array (True: the query sees the key) or an attn.masks.Mask"
    try:
        x = jnp.asarray(x)
    except TypeError:
        fail(name, what if boolean else "a floating-point array", type(x).__name__)
    if x.ndim > 4:
        fail(name, f"an array of rank <= 4 broadcastable to {want}", f"shape {x.shape}")
    if boolean and x.dtype != jnp.bool_:
        fail(name, what, x.dtype)
    if not boolean and not jnp.issubdtype(x.dtype, jnp.floating):
        fail(name, "a floating-point array", x.dtype)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if any(n not in (1, m) for n, m in zip(x.shape, (d.B, d.N, d.T, d.S), strict=True)):
        fail(name, f"a shape broadcastable to {want}", f"shape {x.shape}")
    return x


def grouped(x, K: int, G: int):
    """``[Bb, Nb, Tb, Sb]`` -> ``[Bb, K|1, G|1, Tb, Sb]`` (a view; no copy over heads)."""
    Bb, Nb, Tb, Sb = x.shape
    return x.reshape(Bb, K, G, Tb, Sb) if Nb > 1 else x[:, :, None]


def padded(x, Tp: int, Sp: int, fill):
    """``x [Bb,Nb,Tb,Sb]`` padded with ``fill`` along T and S to ``Tp``, ``Sp`` (unit axes kept)."""
    Tb, Sb = x.shape[2:]
    widths = ((0, 0), (0, 0), (0, 0 if Tb == 1 else Tp - Tb), (0, 0 if Sb == 1 else Sp - Sb))
    return jnp.pad(x, widths, constant_values=fill)


def block_any_all(keep, T: int, S: int, block_q: int, block_k: int):
    """``(xp, any, all)``: per block pair ``[nq, nk]``, some pair of the block is kept / all are.

    Over the batch and the heads too (one schedule serves them all). In NumPy
    (``xp``) when ``keep`` is concrete, so the schedule can be static; else in
    jax.numpy. Positions past T and S count as hidden for ``any`` and kept for
    ``all``: they never make a block visited or PARTIAL by themselves.
    """
    value = concrete(keep)
    xp, x = (jnp, keep) if value is None else (np, value)
    shape = (num_blocks(T, block_q), num_blocks(S, block_k))
    return (
        xp,
        _per_block(xp, x.any((0, 1)), shape, (block_q, block_k), every=False),
        _per_block(xp, x.all((0, 1)), shape, (block_q, block_k), every=True),
    )


def _per_block(xp, y, shape, blocks, every: bool):
    """``y [Tb, Sb]`` (each 1 or the full length) reduced per block, broadcast to ``shape``."""
    sizes = [block if n > 1 else 1 for n, block in zip(y.shape, blocks, strict=True)]
    counts = [nb if n > 1 else 1 for n, nb in zip(y.shape, shape, strict=True)]
    widths = [(0, c * b - n) for c, b, n in zip(counts, sizes, y.shape, strict=True)]
    y = xp.pad(y, widths, constant_values=every).reshape(counts[0], sizes[0], counts[1], sizes[1])
    y = y.all((1, 3)) if every else y.any((1, 3))
    return xp.broadcast_to(y, shape)


def tile(x, start_q: int | jnp.ndarray, start_k, block_q: int, block_k: int):
    """The ``[Bb, Nb, block_q, block_k]`` tile of a padded pair array at (start_q, start_k)."""
    Bb, Nb, Tb, Sb = x.shape
    starts = [jnp.asarray(x, jnp.int32) for x in (0, 0, start_q if Tb > 1 else 0,
                                                  start_k if Sb > 1 else 0)]  # fmt: skip
    sizes = (Bb, Nb, block_q if Tb > 1 else 1, block_k if Sb > 1 else 1)
    return lax.dynamic_slice(x, starts, sizes)
