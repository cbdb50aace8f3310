"""Score modifiers on the tiles of blockwise (and ring) attention.

Internal to ``attn.softmax`` and ``attn.ring``. A modifier's leaves (see
``attn.scores``) are laid out once per call like the operands they go with,
in the tile axis letters of ``attn.softmax.tiles``:

* head leaves ``[N, ...]`` -> ``[groups, X, G, ...]``, one per head group;
* q leaves ``[B,T,N]`` -> ``[groups*nq, X, Q]``, like the query tiles' rows;
* k leaves ``[B,S,N]`` -> ``[groups*nk, X, G, J]``, like the key tiles (per query head).

A tile then picks its group, query tile and key tile (a ``ScoreTiles`` of
single tiles) and ``modify`` evaluates the modifier on the tile's logits,
viewed as ``[X,G,C,J]`` (queries-major, the forward) or ``[X,J,G,C]``
(keys-major, the backward): free reshapes of the kernels' 3-D tiles. The
backward differentiates ``modify`` with ``jax.vjp`` per tile, which gives
both the logits' cotangent and the tile's share of the leaves' cotangents.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from attn import scores
from attn.softmax.tiles import TileConfig, _group, _pad_rows


class ScoreTiles(NamedTuple):
    """A modifier's leaves by role, in tile layout (all of a call's, or one tile's)."""

    head: tuple = ()  # [groups, X, G, ...] each (one tile: [X, G, ...])
    q: tuple = ()  # [groups*nq, X, Q] each (one tile: [X, Q])
    k: tuple = ()  # [groups*nk, X, G, J] each (one tile: [X, G, J])


def score_tiles(config: TileConfig, leaves) -> ScoreTiles:
    """The leaves of the call's modifier (``config.score``) in tile layout."""
    if config.score is None:
        return ScoreTiles()
    groups = config.score.by_role(leaves)
    return ScoreTiles(
        tuple(_head_tiles(config, x) for x in groups["head"]),
        tuple(_q_tiles(config, x) for x in groups["q"]),
        tuple(kv_score_tiles(config, x) for x in groups["k"]),
    )


def _head_tiles(config: TileConfig, x):
    """``[N, ...]`` -> ``[groups, X, G, ...]``."""
    x = jnp.broadcast_to(x, (config.B, *x.shape))
    return x.reshape(config.groups, config.tile_heads, config.G, *x.shape[2:])


def _q_tiles(config: TileConfig, x):
    """``[B,T,N]`` -> ``[groups*nq, X, Q]`` (rows G-major, as the query tiles')."""
    B, K, G, C = config.B, config.K, config.G, config.block_q
    x = _pad_rows(x, config.T, C, "constant")
    x = x.reshape(B, -1, C, K, G).transpose(0, 3, 1, 4, 2)  # [B,K,nq,G,C]
    return _group(config, x.reshape(B * K, -1, G * C))


def kv_score_tiles(config: TileConfig, x):
    """``[B,S,N]`` -> ``[groups*nk, X, G, J]``."""
    B, K, G, J = config.B, config.K, config.G, config.block_k
    x = _pad_rows(x, config.S, J, "constant")
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
    if config.score is None:
        return s
    X, G, C, J = q_pos.shape[0], config.G, q_pos.shape[1], k_pos.shape[1]
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
    leaves = config.score.merge(dict(zip(scores.ROLES, views, strict=True)))
    mod = config.score.rebuild(leaves)
    return mod.apply(s.reshape(shape), *positions).reshape(s.shape)
