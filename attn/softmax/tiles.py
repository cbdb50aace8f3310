"""The tile layout of blockwise attention: one call's configuration and its blocked operands.

Internal to ``attn.softmax`` and ``attn.ring``. Queries are cut into blocks of ``block_q``
positions and keys/values into blocks of ``block_k``; both are padded to whole
blocks. The B*K kv heads of all batch entries are split into ``groups`` of
``tile_heads`` heads, and a tile is a (query block, key block) pair for one
group. Every tile is a 3-D batch of plain matmuls, with these axis letters
besides the vocabulary:

    X  the kv heads of one tile (``tile_heads`` of the B*K): a flattened batch
       of matmuls, as in ``attn.linear.forms``
    Q  the query rows of one tile: its G query heads times the block's
       ``block_q`` positions (C), G-major, so G*C rows in all
    J  the key positions of one key block (``block_k``), as J is the key
       position inside a chunk in ``attn.linear.forms``

Leading axes count tiles: ``groups*nq`` query tiles and ``groups*nk`` key/value
tiles for ``nq`` query blocks and ``nk`` key blocks; tile ``g*nq + i`` holds
query block i of head group g.

A score modifier's leaves (``attn.scores``) are laid out once per call like
the operands they go with (``score_tiles``): head leaves ``[N, ...]`` ->
``[groups, X, G, ...]``, q leaves ``[B,T,N]`` -> ``[groups*nq, X, Q]`` (like the
query tiles' rows), k leaves ``[B,S,N]`` -> ``[groups*nk, X, G, J]`` (like the key
tiles, per query head). A tile then picks its group, query tile and key tile
(``tile_of``) and ``modify`` evaluates the modifier on the tile's logits,
viewed as ``[X,G,C,J]`` (queries-major, the forward) or ``[X,J,G,C]``
(keys-major, the backward): free reshapes of the kernels' 3-D tiles. The
backward differentiates ``modify`` with ``jax.vjp`` per tile, which gives
both the logits' cotangent and the tile's share of the leaves' cotangents.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import chex
import jax.numpy as jnp
import numpy as np

from attn import scores
from attn.checks import positive_int
from attn.softmax import pairs
from attn.softmax.call import Call, CallSpec
from attn.softmax.schedule import BlockSpec, num_blocks


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Hashable configuration of one call: what the kernels need to know at trace time.

    A static (``nondiff_argnums``) argument of the custom VJP, so a new
    configuration means a new trace.
    """

    call: CallSpec
    block_q: int  # C of the query tiles
    block_k: int  # J of the key tiles
    dtype: str  # of the output
    tile_heads: int  # X: kv heads (of all batch entries, B*K) per tile; divides B*K

    @property
    def blocks(self) -> BlockSpec:
        """The call cut into this configuration's blocks (what its schedule is built on)."""
        return BlockSpec(self.call, self.block_q, self.block_k)

    @property
    def groups(self) -> int:
        """Head groups: tiles per (query block, key block) pair."""
        return self.call.B * self.call.K // self.tile_heads


def tile_config(call: Call, block_q, block_k, dtype, tile_scores: int) -> TileConfig:
    """The configuration of a checked call for the given block sizes.

    Groups as many kv heads per tile as fit in ``tile_scores`` scores.
    """
    block_q, block_k = positive_int(block_q, "block_q"), positive_int(block_k, "block_k")
    dims = call.dims
    # A block longer than the sequence only adds padding.
    bq, bk = int(min(block_q, dims.T)), int(min(block_k, dims.S))
    return TileConfig(
        call=call.spec(),
        block_q=bq,
        block_k=bk,
        dtype=jnp.dtype(dtype).name,
        tile_heads=_heads_per_tile(dims.B * dims.K, dims.G * bq * bk, tile_scores),
    )


def _heads_per_tile(heads: int, scores_per_head: int, tile_scores: int) -> int:
    """The most kv heads (a divisor of ``heads``) whose tile holds <= ``tile_scores`` scores."""
    fit = max(1, tile_scores // scores_per_head)
    return max(d for d in range(1, heads + 1) if heads % d == 0 and d <= fit)


def _pad_rows(x, length: int, block: int, mode: str):
    """Pads axis 1 of ``[B, L, ...]`` to a whole number of blocks."""
    pad = num_blocks(length, block) * block - length
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


def qkv_tiles(config: TileConfig, q, k, v):
    """Blocked operands of the kernels, 3-D per tile so tiles are plain matmul batches.

    Returns scaled q ``[groups*nq, X, Q, H]``, kT ``[groups*nk, X, H, J]`` and
    v ``[groups*nk, X, J, E]``. The G query heads sharing a kv head are stacked
    as rows, so GQA needs no repeated K/V. Keys are stored transposed because
    ``q @ kT`` is the plain product XLA:CPU runs fastest. Padding rows and keys
    are zeros (padding keys are also masked).
    """
    B, T, N, H = q.shape
    K, G = config.call.K, N // config.call.K
    q = _pad_rows(_scaled(q, config.call.scale), T, config.block_q, "constant")
    q = q.reshape(B, -1, config.block_q, K, G, H).transpose(0, 3, 1, 4, 2, 5)  # [B,K,nq,G,C,H]
    q = q.reshape(B * K, -1, G * config.block_q, H)
    q, kT, v = _group(config, q), _kv_tiles(config, k).swapaxes(-1, -2), _kv_tiles(config, v)
    chex.assert_shape(q, (None, config.tile_heads, G * config.block_q, H))
    chex.assert_shape(kT, (None, config.tile_heads, H, config.block_k))
    chex.assert_equal_shape_prefix([kT, v], 2)
    return q, kT, v


def _scaled(q, scale: float):
    """``q * scale``: folding the logit scale into q saves a pass over every score tile.

    Exact when the scale is a power of two (``1/sqrt(H)`` for H = 16, 64, 256);
    otherwise half-precision queries are kept in float32 so no rounding beyond
    float32's is added to the logits.
    """
    exact = np.log2(scale).is_integer() or jnp.finfo(q.dtype).bits >= 32
    dtype = q.dtype if exact else jnp.float32
    return (q.astype(jnp.float32) * scale).astype(dtype)


def _kv_tiles(config: TileConfig, x):
    """``[B,S,K,H]`` -> ``[groups*nk, X, J, H]``."""
    B, S, K, H = x.shape
    x = _pad_rows(x, S, config.block_k, "constant")
    x = x.reshape(B, -1, config.block_k, K, H).transpose(0, 3, 1, 2, 4)  # [B,K,nk,J,H]
    return _group(config, x.reshape(B * K, -1, config.block_k, H))


def _group(config: TileConfig, x):
    """Per kv head ``[B*K, nb, ...]`` -> per tile ``[groups*nb, X, ...]``."""
    nb = x.shape[1]
    x = x.reshape(config.groups, config.tile_heads, nb, *x.shape[2:]).swapaxes(1, 2)
    return x.reshape(config.groups * nb, config.tile_heads, *x.shape[3:])


def _ungroup(config: TileConfig, x):
    """Inverse of ``_group``: ``[groups*nb, X, ...]`` -> ``[B*K, nb, ...]``."""
    x = x.reshape(config.groups, -1, config.tile_heads, *x.shape[2:]).swapaxes(1, 2)
    return x.reshape(config.call.B * config.call.K, -1, *x.shape[3:])


def untile(config: TileConfig, x):
    """Query tiles ``[groups*nq, X, Q, E]`` -> ``[B,T,N,E]`` (padding rows dropped)."""
    c, E = config.call, x.shape[-1]
    x = _ungroup(config, x).reshape(c.B, c.K, -1, c.G, config.block_q, E)
    x = x.transpose(0, 2, 4, 1, 3, 5)  # [B,nq,C,K,G,E]
    return x.reshape(c.B, -1, c.K * c.G, E)[:, : c.T]


def row_tiles(config: TileConfig, x, length: int, block: int):
    """Integer ``[B, L]`` (positions, segment ids) -> per tile ``[groups*nb, X, block]``.

    Padding repeats the last entry, which keeps every block's min/max, and so
    the block classification, that of its real rows.
    """
    B, K = config.call.B, config.call.K
    x = _pad_rows(x, length, block, "edge")
    x = jnp.broadcast_to(x[:, None], (B, K, x.shape[1]))
    return _group(config, x.reshape(B * K, -1, block))


class ScoreTiles(NamedTuple):
    """A modifier's leaves by role, in tile layout (all of a call's, or one tile's), and
    the call's bias (``attn.softmax.pairs``), which is differentiated the same way."""

    head: tuple = ()  # [groups, X, G, ...] each (one tile: [X, G, ...])
    q: tuple = ()  # [groups*nq, X, Q] each (one tile: [X, Q])
    k: tuple = ()  # [groups*nk, X, G, J] each (one tile: [X, G, J])
    pair: tuple = ()  # the bias padded, [B|1, N|1, Tp|1, Sp|1] (read per tile: pair_tile)


def score_tiles(config: TileConfig, leaves, bias=None) -> ScoreTiles:
    """The leaves of the call's modifier (``config.call.score``) in tile layout, and its bias."""
    pair = () if bias is None else (padded_pair(config, bias, 0.0),)
    if config.call.score is None:
        return ScoreTiles(pair=pair)
    groups = config.call.score.by_role(leaves)
    return ScoreTiles(
        tuple(_head_tiles(config, x) for x in groups["head"]),
        tuple(_q_tiles(config, x) for x in groups["q"]),
        tuple(kv_score_tiles(config, x) for x in groups["k"]),
        pair,
    )


def padded_pair(config: TileConfig, x, fill):
    """A pair array ``[B|1, N|1, T|1, S|1]`` padded to whole blocks with ``fill``."""
    nq, nk = num_blocks(config.call.T, config.block_q), num_blocks(config.call.S, config.block_k)
    return pairs.padded(x, nq * config.block_q, nk * config.block_k, fill)


def _pair_heads(config: TileConfig, group, shape):
    """Index arrays ``[X]`` of the tile's kv heads into a pair array's B and K|1 axes."""
    heads = group * config.tile_heads + jnp.arange(config.tile_heads)
    zero = jnp.zeros_like(heads)
    B, N = shape[:2]
    return (heads // config.call.K if B > 1 else zero), (heads % config.call.K if N > 1 else zero)


def pair_tile(config: TileConfig, x, group, i, j):
    """Tile ``(i, j)`` of head group ``group`` of a padded pair array: ``[X, G, C, J]``.

    ``i`` and ``j`` are the query and key block within the group; only the
    tile is read, whatever the array broadcasts over.
    """
    c, C, J = config.call, config.block_q, config.block_k
    t = pairs.tile(x, i * C, j * J, C, J)  # [B|1, N|1, C|1, J|1]
    t = pairs.grouped(t, c.K, c.G)
    b, k = _pair_heads(config, group, x.shape)
    return jnp.broadcast_to(t[b, k], (config.tile_heads, c.G, C, J))


def add_pair_tile(config: TileConfig, acc, d, group, i, j):
    """``acc`` (a padded pair array's shape) plus tile ``(i, j)``'s cotangent ``d [X, G, C, J]``,
    summed over the axes the array broadcasts over."""
    c, C, J = config.call, config.block_q, config.block_k
    B, N, Tb, Sb = acc.shape
    d = d.sum(axis=tuple(a for a, n in ((1, N), (2, Tb), (3, Sb)) if n == 1), keepdims=True)
    b, k = _pair_heads(config, group, acc.shape)
    g = jnp.arange(c.G if N > 1 else 1)
    t = i * C + jnp.arange(C) if Tb > 1 else jnp.zeros(1, jnp.int32)
    s = j * J + jnp.arange(J) if Sb > 1 else jnp.zeros(1, jnp.int32)
    grouped = acc.reshape(B, c.K if N > 1 else 1, c.G if N > 1 else 1, Tb, Sb)
    index = (b[:, None, None, None], k[:, None, None, None], g[None, :, None, None],
             t[None, None, :, None], s[None, None, None, :])  # fmt: skip
    return grouped.at[index].add(d.astype(acc.dtype)).reshape(acc.shape)


def _head_tiles(config: TileConfig, x):
    """``[N, ...]`` -> ``[groups, X, G, ...]``."""
    x = jnp.broadcast_to(x, (config.call.B, *x.shape))
    return x.reshape(config.groups, config.tile_heads, config.call.G, *x.shape[2:])


def _q_tiles(config: TileConfig, x):
    """``[B,T,N]`` -> ``[groups*nq, X, Q]`` (rows G-major, as the query tiles')."""
    (B, K, G), C = (config.call.B, config.call.K, config.call.G), config.block_q
    x = _pad_rows(x, config.call.T, C, "constant")
    x = x.reshape(B, -1, C, K, G).transpose(0, 3, 1, 4, 2)  # [B,K,nq,G,C]
    return _group(config, x.reshape(B * K, -1, G * C))


def kv_score_tiles(config: TileConfig, x):
    """``[B,S,N]`` -> ``[groups*nk, X, G, J]``."""
    (B, K, G), J = (config.call.B, config.call.K, config.call.G), config.block_k
    x = _pad_rows(x, config.call.S, J, "constant")
    x = x.reshape(B, -1, J, K, G).transpose(0, 3, 1, 4, 2)  # [B,K,nk,G,J]
    return _group(config, x.reshape(B * K, -1, G, J))


def tile_of(tiles: ScoreTiles, group, i_leaves, j) -> ScoreTiles:
    """One tile's leaves: head group ``group``, the query tile's ``i_leaves``, key tile ``j``."""
    return ScoreTiles(
        tuple(x[group] for x in tiles.head), tuple(i_leaves), tuple(x[j] for x in tiles.k)
    )


def modify(config: TileConfig, s, tile: ScoreTiles, q_pos, k_pos, keys_major: bool):
    """A tile's logits through the modifier.

    Args:
      s: float32 scaled logits ``[X,Q,J]``, or ``[X,J,Q]`` keys-major.
      tile: the tile's leaves (``tile_of``).
      q_pos: int32 ``[X,C]``; k_pos: int32 ``[X,J]``.
    """
    structure = config.call.score
    if structure is None:
        return s
    X, G, C, J = q_pos.shape[0], config.call.G, q_pos.shape[1], k_pos.shape[1]
    if keys_major:
        views = (
            [x.reshape(X, 1, G, 1, *x.shape[2:]) for x in tile.head],
            [x.reshape(X, 1, G, C) for x in tile.q],
            [x.swapaxes(1, 2)[..., None] for x in tile.k],
        )
        positions = q_pos[:, None, None, :], k_pos[:, :, None, None]
        shape = (X, J, G, C)
    else:
        views = (
            [x.reshape(X, G, 1, 1, *x.shape[2:]) for x in tile.head],
            [x.reshape(X, G, C, 1) for x in tile.q],
            [x[:, :, None, :] for x in tile.k],
        )
        positions = q_pos[:, None, :, None], k_pos[:, None, None, :]
        shape = (X, G, C, J)
    views = dict(zip(scores.ROLES, views, strict=True))
    return structure.apply(s.reshape(shape), *positions, views).reshape(s.shape)
