"""The kernels of blockwise attention: the online-softmax forward, the FlashAttention-2 backward.

Internal to ``attn.softmax`` (and ``attn.ring``, whose steps run them);
``attn.softmax.blockwise`` describes the algorithm. A tile is a
(query block, key block) pair for one group of kv heads (``config.tile_heads``
of the B*K heads of all batch entries) as 3-D matmul batches, with the axis
letters of ``attn.softmax.tiles``: X the tile's kv heads, Q its G*C query
rows (the G query heads of each kv head stacked) and J its keys::

    forward:  q [X,Q,H] @ kT [X,H,J] -> scores [X,Q,J];  p [X,Q,J] @ v [X,J,E]
    backward: k [X,J,H] @ qT [X,H,Q] -> transposed scores [X,J,Q]

Every matmul is a plain (row-major x row-major) product: XLA:CPU runs products
with a transposed left operand several times slower, so the backward works on
transposed tiles (keys as rows), where dV, dK and dQ^T are all plain products.
Tiles are kept 3-D: with unit B or G axes XLA:CPU inserts a copy of every
score tile between the matmul and the reductions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn.masks import BlockKind
from attn.merge import merge_unnormalized
from attn.softmax.call import MASKED, visible
from attn.softmax.schedule import Schedule, build_schedule, num_blocks
from attn.softmax.tiles import (
    ScoreTiles,
    TileConfig,
    add_pair_tile,
    modify,
    padded_pair,
    pair_tile,
    row_tiles,
    tile_of,
)


class KernelInputs(NamedTuple):
    """The integer inputs of the kernels, blocked like q and k; no gradient flows to them.

    The schedule, and per tile what the mask and the segment rule look at.
    """

    schedule: Schedule
    q_pos: jax.Array  # [groups*nq, X, C] int32
    kv_pos: jax.Array  # [groups*nk, X, J] int32
    kv_valid: jax.Array  # [groups*nk, J] bool: False on padding keys
    q_seg: jax.Array | None  # [groups*nq, X, C] int32
    kv_seg: jax.Array | None  # [groups*nk, X, J] int32
    keep: jax.Array | None = None  # the boolean mask array padded (read per tile: pair_tile)


def kernel_inputs(config: TileConfig, rows: Sequence, static: Sequence | None,
                  keep=None) -> KernelInputs:  # fmt: skip
    """Per-tile positions, segment ids and padding, and the schedule of every query tile.

    Args:
      config: the call's tiles.
      rows: int32 q positions ``[B,T]``, kv positions ``[B,S]`` and, with segment
        ids, q ids ``[B,T]`` and kv ids ``[B,S]``.
      static: the same in NumPy when known at trace time (the schedule is then
        computed when tracing), or None (at run time).
      keep: the call's boolean mask array ``[B|1, N|1, T|1, S|1]``, or None.
    """
    schedule = _for_groups(config, build_schedule(config.blocks, rows, static, keep))
    lengths, blocks = (config.call.T, config.call.S) * 2, (config.block_q, config.block_k) * 2
    tiles = [row_tiles(config, *row) for row in zip(rows, lengths, blocks, strict=False)]
    q_pos, kv_pos, *segments = tiles
    q_seg, kv_seg = segments if segments else (None, None)
    nk = num_blocks(config.call.S, config.block_k)
    kv_valid = (np.arange(nk * config.block_k) < config.call.S).reshape(nk, config.block_k)
    kv_valid = jnp.asarray(np.tile(kv_valid, (config.groups, 1)))
    keep = None if keep is None else padded_pair(config, keep, False)
    return KernelInputs(schedule, q_pos, kv_pos, kv_valid, q_seg, kv_seg, keep)


def _for_groups(config: TileConfig, blocks: Schedule) -> Schedule:
    """Repeats the schedule of the query blocks for each head group's tiles.

    Head group g's key tiles are ``g*nk + j``, so its key block indices are offset by ``g*nk``.
    """
    nq, nk = num_blocks(config.call.T, config.block_q), num_blocks(config.call.S, config.block_k)
    offsets = jnp.arange(config.groups, dtype=jnp.int32)[:, None, None] * nk
    key_tile = (offsets + blocks.key_tile[None]).reshape(config.groups * nq, -1)
    kind = jnp.tile(blocks.kind, (config.groups, 1))
    return Schedule(key_tile, kind, jnp.tile(blocks.count, config.groups))


def _tile_mask(config: TileConfig, inputs: KernelInputs, q_pos_i, q_seg_i, at, keys_major: bool):
    """Boolean visibility of tile ``at = (group, i, j)``: ``[X,Q,J]``, or ``[X,J,Q]`` keys-major.

    ``j`` is the key tile's index among all tiles, ``i`` the query block's in its group.
    """
    group, i, j = at
    k_seg_j = None if inputs.kv_seg is None else inputs.kv_seg[j]
    ok = visible(config.call.mask, q_pos_i, inputs.kv_pos[j], q_seg_i, k_seg_j)
    ok = ok & inputs.kv_valid[j][None, None, :]  # [X,C,J]
    X, C, J = ok.shape
    G = config.call.G
    ok = jnp.broadcast_to(ok[:, None], (X, G, C, J))  # the G query heads of a kv head share it
    if inputs.keep is not None:
        ok = ok & pair_tile(config, inputs.keep, group, i, j % _key_blocks(config))
    return _oriented(ok, keys_major)


def _oriented(x, keys_major: bool):
    """A tile ``[X,G,C,J]`` as the kernels hold it: ``[X,Q,J]``, or ``[X,J,Q]`` keys-major."""
    X, G, C, J = x.shape
    if keys_major:
        return x.transpose(0, 3, 1, 2).reshape(X, J, G * C)
    return x.reshape(X, G * C, J)


def _unoriented(config: TileConfig, x, keys_major: bool):
    """Inverse of ``_oriented``: ``[X,Q,J]`` or ``[X,J,Q]`` -> ``[X,G,C,J]``."""
    G, C = config.call.G, config.block_q
    if keys_major:
        X, J, _ = x.shape
        return x.reshape(X, J, G, C).transpose(0, 2, 3, 1)
    X, _, J = x.shape
    return x.reshape(X, G, C, J)


def _key_blocks(config: TileConfig) -> int:
    return num_blocks(config.call.S, config.block_k)


def _query_blocks(config: TileConfig) -> int:
    return num_blocks(config.call.T, config.block_q)


def _bias_tile(config: TileConfig, mod: ScoreTiles, at, keys_major: bool):
    """The bias's float32 tile at ``(group, i, j)`` (oriented), or None without a bias."""
    if not mod.pair:
        return None
    group, i, j = at
    tile = pair_tile(config, mod.pair[0], group, i, j % _key_blocks(config))
    return _oriented(tile.astype(jnp.float32), keys_major)


def _visit(key_tile, kind, count, tile, combine, carry):
    """Folds the ``count`` scheduled key tiles of one query tile into ``carry``.

    For key tile ``j``, ``tile(j, masked)`` computes the tile's contribution and
    ``combine(carry, j, full, contribution)`` adds it. ``masked`` is static:
    FULL tiles run a variant that never evaluates the mask. Only the small
    per-tile results cross the ``lax.cond``; big loop-carried buffers passed
    through it would be copied on every step.
    """

    def body(t, carry):
        j, full = key_tile[t], kind[t] == BlockKind.FULL
        unmasked = functools.partial(tile, masked=False)
        masked = functools.partial(tile, masked=True)
        return combine(carry, j, full, lax.cond(full, unmasked, masked, j))

    return lax.fori_loop(0, count, body, carry)


def _new(like, shape, value=0.0, dtype=jnp.float32):
    """A constant loop carry that varies across devices where ``like`` does.

    Inside ``jax.shard_map`` a carry must keep its type, which records the mesh
    axes it varies over (``vma``); a carry updated from sharded queries varies,
    so its initial value must already (``*_like`` inherits it; plain
    ``jnp.zeros`` would not, and the loop would refuse a sharded q).
    """
    return jnp.full_like(like, value, dtype=dtype, shape=shape)


def vary_like(x, like):
    """``x`` varying over every mesh axis ``like`` varies over (inside ``jax.shard_map``).

    A custom VJP's cotangent must have its input's type. Sink logits replicated
    over the axes that shard the queries get a cotangent that varies there, so
    they must enter the VJP varying. Adding a zero that varies like ``like``
    (see ``_new``) makes JAX insert that cast, whose transpose sums the
    cotangent over those axes; outside ``shard_map`` it adds 0 and nothing else.
    """
    return x + _new(like, (), dtype=x.dtype)


def _sink_rows(config: TileConfig, sink):
    """Sink logits ``[K,G]`` as per-row values of each head group: ``[groups, X, Q]``."""
    (B, K, G), C = (config.call.B, config.call.K, config.call.G), config.block_q
    rows = jnp.broadcast_to(sink[None, :, :, None], (B, K, G, C))
    return rows.reshape(config.groups, config.tile_heads, G * C)


def forward(config: TileConfig, q, kT, v, sink, mod: ScoreTiles, inputs: KernelInputs):
    """Online softmax over the schedule.

    Args:
      q: ``[groups*nq, X, Q, H]`` query tiles, already multiplied by the logit scale.
      kT: ``[groups*nk, X, H, J]`` key tiles, transposed; v: ``[groups*nk, X, J, E]``.
      sink: float32 ``[K,G]`` (ignored unless ``config.call.has_sink``).
      mod: the score modifier's leaves in tile layout (empty without one).
      inputs: the schedule, positions, padding and segment ids of the tiles.

    Returns:
      ``out [groups*nq, X, Q, E]`` in the output dtype, ``lse [groups*nq, X, Q]``
      float32 and the counts ``(full, partial)`` of tiles computed.
    """
    n_tiles, X, Q, _ = q.shape
    E = v.shape[-1]
    sink_rows = _sink_rows(config, sink)

    def q_tile(counts, xs):
        q_i, group, i, q_pos_i, q_seg_i, mod_i, key_tile, kind, count = xs

        def tile(j, masked):
            s = jnp.einsum("XQH,XHJ->XQJ", q_i, kT[j], preferred_element_type=jnp.float32)
            tile_mod = tile_of(mod, group, mod_i, j)  # q is pre-scaled:
            s = modify(config, s, tile_mod, q_pos_i, inputs.kv_pos[j], keys_major=False)
            bias = _bias_tile(config, mod, (group, i, j), keys_major=False)
            s = s if bias is None else s + bias
            if masked:
                ok = _tile_mask(config, inputs, q_pos_i, q_seg_i, (group, i, j), keys_major=False)
                s = jnp.where(ok, s, MASKED)
            # At least MASKED: a row whose keys here are all past a gate of 0 (-inf) has p = 0.
            m_j = jnp.maximum(s.max(-1), MASKED)
            # Masked logits give exp(MASKED - m_j) = 0, except in rows with no
            # visible key in this tile (m_j = MASKED): those are zeroed per row below.
            p = jnp.exp(s - m_j[..., None])
            l_j = p.sum(-1)
            pv = jnp.einsum(
                "XQJ,XJE->XQE", p.astype(v.dtype), v[j], preferred_element_type=jnp.float32
            )
            if masked:
                seen = m_j > MASKED
                l_j, pv = jnp.where(seen, l_j, 0.0), jnp.where(seen[..., None], pv, 0.0)
            return m_j, l_j, pv

        def combine(state, j, full, part):
            m, l, acc, tile_counts = state
            m, l, acc = merge_unnormalized(m, l, acc, *part)
            return m, l, acc, tile_counts + jnp.stack([full, ~full]).astype(jnp.int32)

        new = functools.partial(_new, q_i)
        if config.call.has_sink:  # the sink is one more logit with no value: max = sink, sum = 1
            m0, l0 = sink_rows[group] + new((X, Q)), new((X, Q), 1.0)
        else:
            m0, l0 = new((X, Q), MASKED), new((X, Q))
        state = (m0, l0, new((X, Q, E)), new((2,), 0, jnp.int32))
        m, l, acc, tile_counts = _visit(key_tile, kind, count, tile, combine, state)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        return counts + tile_counts, (out.astype(config.dtype), lse)

    nq = _query_blocks(config)
    groups, blocks = jnp.arange(n_tiles) // nq, jnp.arange(n_tiles) % nq  # of each query tile
    xs = (q, groups, blocks, inputs.q_pos, inputs.q_seg, mod.q, *inputs.schedule)
    counts, (out, lse) = lax.scan(q_tile, _new(q, (2,), 0, jnp.int32), xs)
    return out, lse, (counts[0], counts[1])


def backward(
    config: TileConfig,
    q,
    kT,
    v,
    sink,
    mod: ScoreTiles,
    inputs: KernelInputs,
    out,
    lse,
    d_out,
    d_lse,
    grad_dtype=None,
):
    """FlashAttention-2 backward, recomputing each tile's probabilities from the lse.

    Arguments as ``forward``'s, plus its outputs and their cotangents. Returns
    ``(dq, dkT, dv, dsink, dmod)`` in the layouts of q, kT, v (``[K,G]`` or
    None, and a float32 ``ScoreTiles`` like ``mod``), in their dtypes, or all
    in ``grad_dtype`` if given: a caller that sums several backwards (ring
    attention's steps) asks for float32 so that half-precision inputs are
    rounded once, after the sum. A modifier's leaves get, per tile, the
    cotangent ``jax.vjp`` of ``modify`` gives.
    """
    _, X, Q, H = q.shape
    k = kT.swapaxes(-1, -2)  # [groups*nk, X, J, H]
    qT = q.swapaxes(-1, -2)  # [groups*nq, X, H, Q]
    # D = rowsum(dO * O), less the lse cotangent: d lse / d logit = P, so both
    # enter dS = P * (dP - D + d_lse) the same way.
    delta = jnp.einsum("...E,...E->...", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse
    # A row that sees nothing has lse = -inf; +inf makes its P = exp(x - inf) = 0.
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)

    n_tiles, nq = q.shape[0], _query_blocks(config)
    groups, blocks = jnp.arange(n_tiles) // nq, jnp.arange(n_tiles) % nq

    def q_tile(carry, xs):
        q_i, qT_i, do_i, lse_i, delta_i, q_pos_i, q_seg_i, group, i, mod_i = xs[:10]
        key_tile, kind, count = xs[10:]
        doT_i = do_i.swapaxes(-1, -2)  # [X,E,Q]
        lse_i, delta_i = lse_i[:, None], delta_i[:, None]  # [X,1,Q]: one per column

        def tile(j, masked):
            sT = jnp.einsum("XJH,XHQ->XJQ", k[j], qT_i, preferred_element_type=jnp.float32)

            def modified(sT, tile_mod):
                return modify(config, sT, tile_mod, q_pos_i, inputs.kv_pos[j], keys_major=True)

            # The modifier's derivative, from the unmasked logits (finite everywhere).
            xT, mod_vjp = jax.vjp(modified, sT, tile_of(mod, group, mod_i, j))
            bias = _bias_tile(config, mod, (group, i, j), keys_major=True)
            xT = xT if bias is None else xT + bias
            if masked:  # exp(MASKED - lse) = 0: no need to mask P itself
                ok = _tile_mask(config, inputs, q_pos_i, q_seg_i, (group, i, j), keys_major=True)
                xT = jnp.where(ok, xT, MASKED)
            pT = jnp.exp(xT - lse_i)
            dv_j = jnp.einsum(
                "XJQ,XQE->XJE", pT.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32
            )
            dpT = jnp.einsum("XJE,XEQ->XJQ", v[j], doT_i, preferred_element_type=jnp.float32)
            dxT = pT * (dpT - delta_i)  # the bias's cotangent, as it is added after the modifier
            dsT, dmod_j = mod_vjp(dxT)
            dsT = dsT.astype(q.dtype)
            dk_j = jnp.einsum("XJQ,XQH->XJH", dsT, q_i, preferred_element_type=jnp.float32)
            dqT_j = jnp.einsum("XHJ,XJQ->XHQ", kT[j], dsT, preferred_element_type=jnp.float32)
            dbias_j = () if bias is None else (dxT,)
            return dqT_j, dk_j, dv_j, dmod_j, dbias_j

        def combine(state, j, full, part):
            dqT_i, dmod_i, dk, dv, dmod_k, dbias = state
            dqT_j, dk_j, dv_j, dmod_j, dbias_j = part
            dk = lax.dynamic_update_index_in_dim(dk, dk[j] + dk_j, j, 0)
            dv = lax.dynamic_update_index_in_dim(dv, dv[j] + dv_j, j, 0)
            dmod_k = tuple(
                lax.dynamic_update_index_in_dim(d, d[j] + d_j, j, 0)
                for d, d_j in zip(dmod_k, dmod_j.k, strict=True)
            )
            dmod_i = jax.tree.map(jnp.add, dmod_i, dmod_j._replace(k=()))
            dbias = tuple(
                add_pair_tile(config, acc, _unoriented(config, d, keys_major=True), group, i,
                              j % _key_blocks(config))
                for acc, d in zip(dbias, dbias_j, strict=True)
            )  # fmt: skip
            return dqT_i + dqT_j, dmod_i, dk, dv, dmod_k, dbias

        dqT_i = _new(q_i, (X, H, Q))
        dmod_i = jax.tree.map(lambda x: _new(q_i, x.shape[1:]), mod._replace(k=(), pair=()))
        state = (dqT_i, dmod_i, *carry)
        dqT_i, dmod_i, *carry = _visit(key_tile, kind, count, tile, combine, state)
        return tuple(carry), (dqT_i.swapaxes(-1, -2).astype(grad_dtype or q.dtype), dmod_i)

    carry0 = (
        _new(q, k.shape),
        _new(q, v.shape),
        tuple(_new(q, x.shape) for x in mod.k),
        tuple(_new(q, x.shape) for x in mod.pair),
    )
    xs = (q, qT, d_out, lse, delta, inputs.q_pos, inputs.q_seg, groups, blocks, mod.q)
    (dk, dv, dmod_k, dbias), (dq, dmod_q) = lax.scan(q_tile, carry0, (*xs, *inputs.schedule))
    # Per query tile -> per head group: the head leaves' cotangents summed over query tiles.
    dmod_head = tuple(d.reshape(config.groups, -1, *d.shape[1:]).sum(1) for d in dmod_q.head)
    dmod = ScoreTiles(dmod_head, dmod_q.q, dmod_k, dbias)
    dsink = None
    if config.call.has_sink:
        # d lse / d sink = P_sink = exp(sink - lse), so d sink = -sum_rows P_sink * (D - d_lse).
        lse, delta = (x.reshape(config.groups, -1, X, Q) for x in (lse, delta))
        p_sink = jnp.exp(_sink_rows(config, sink)[:, None] - lse)
        (B, K, G), C = (config.call.B, config.call.K, config.call.G), config.block_q
        per_row = (p_sink * delta).reshape(config.groups, -1, X, G, C)
        per_row = per_row.swapaxes(1, 2).reshape(B, K, -1, G, C)
        dsink = -per_row.sum((0, 2, 4))
    dk, dv = dk.swapaxes(-1, -2).astype(grad_dtype or kT.dtype), dv.astype(grad_dtype or v.dtype)
    return dq, dk, dv, dsink, dmod


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash(config: TileConfig, q, kT, v, sink, mod: ScoreTiles, inputs: KernelInputs):
    """``(out, lse)`` of ``forward``, differentiated by the memory-linear ``backward``.

    Saves only q, k, v, the modifier's leaves, the output and the lse for the backward pass.
    """
    out, lse, _ = forward(config, q, kT, v, sink, mod, inputs)
    return out, lse


def _flash_fwd(config, q, kT, v, sink, mod, inputs):
    out, lse, _ = forward(config, q, kT, v, sink, mod, inputs)
    return (out, lse), (q, kT, v, sink, mod, inputs, out, lse)


def _flash_bwd(config, residuals, cotangents):
    q, kT, v, sink, mod, inputs, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dkT, dv, dsink, dmod = backward(config, q, kT, v, sink, mod, inputs, out, lse, d_out, d_lse)
    chex.assert_equal_shape([dq, q])
    chex.assert_equal_shape([dkT, kT])
    chex.assert_equal_shape([dv, v])
    dmod = jax.tree.map(lambda d, x: d.astype(x.dtype), dmod, mod)
    return dq, dkT, dv, dsink, dmod, None  # the integer inputs get no cotangent


flash.defvjp(_flash_fwd, _flash_bwd)
