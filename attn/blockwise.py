"""Blockwise softmax attention: the FlashAttention algorithm in JAX.

The same function as ``attn.dot_product_attention``, computed tile by tile so
the ``[T,S]`` score matrix never exists:

* Forward (online softmax). Queries are cut into blocks of ``block_q`` rows and
  keys/values into blocks of ``block_k``. For each query block, the key blocks
  it can see are visited one at a time; each gives a partial result
  ``(row max, row sum, weighted values)`` in float32 that is merged into the
  running one with ``attn.merge.merge_unnormalized``. The output and the row
  log-sum-exp are what remains when the last key block has been merged.
* Block skipping. The mask's block classification (``Mask.classify``) marks
  each (query block, key block) pair EMPTY, FULL or PARTIAL. Only non-empty
  pairs are visited (causal attention: about half of them; a sliding window of
  ``w``: ``O(T w)`` work) and only PARTIAL pairs evaluate the mask. With the
  default ``arange`` positions, or positions and segment ids given as concrete
  arrays, the schedule is computed in NumPy when tracing; with traced positions
  or segment ids it is computed at run time from each block's min/max position
  (and segment id), so packed sequences skip the blocks between segments too.
* Backward (FlashAttention-2). A ``jax.custom_vjp`` saves only q, k, v, the
  output and the log-sum-exp, and recomputes the probabilities block by block:
  ``P = exp(logits - lse)``, ``dV += P^T dO``, ``dP = dO V^T``,
  ``dS = P * (dP - D)`` with ``D = rowsum(dO * O)``, ``dQ += dS K``,
  ``dK += dS^T Q``. Memory grows linearly in T and S.

Any T and S work: both are padded to whole blocks; padded keys are masked (the
last key block is never treated as FULL when it holds padding) and padded
query rows are computed on the last real row's position and dropped.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn._checks import default_positions, fail
from attn.dense import MASKED, check_call, visible
from attn.masks import BlockKind, Mask
from attn.merge import merge_unnormalized

# Default tile sizes, measured on a 2-core AVX-512 CPU (causal, f32, B=1, N=8,
# H=64, T=8192; best of 3-4 interleaved runs on a quiet machine):
#
#   block_q x block_k, kv heads per tile   forward   forward+backward
#   1024 x 512, 1                          0.62 s    1.91 s
#   1024 x 1024, 2                         0.58 s    2.03 s
#   1024 x 1024, 1                         0.62 s    2.24 s
#   512 x 512, 1 or 8                      0.72 s    2.28 s
#   256 x 512, 1                           ~1.2x 512 x 512
#
# Smaller tiles pay the loop's fixed cost per tile (an iteration, slicing K/V,
# merging the accumulator, small matmuls) more often; bigger ones waste work on
# the diagonal of causal and banded masks. 1024 x 512 is the best sum of both
# passes. Heads are grouped so a tile holds at most TILE_SCORES scores (one
# head at 1024 x 512): float32 scores of 2 MB, half of it per core, in its
# 1.25 MB L2 cache. A tile holds one head when one head's block pair is bigger.
DEFAULT_BLOCK_Q = 1024
DEFAULT_BLOCK_K = 512
TILE_SCORES = 2**19


class BlockCounts(NamedTuple):
    """(query block, key block) pairs the forward pass visits, counted by its loop."""

    full: int  # computed without evaluating the mask
    partial: int  # computed with the mask
    total: int  # all pairs, ceil(T / block_q) * ceil(S / block_k)


class _Static(NamedTuple):
    """Hashable configuration of one call: what the kernels need at trace time."""

    mask: Mask
    scale: float
    softcap: float | None
    has_sink: bool
    has_segments: bool
    T: int
    S: int
    B: int
    K: int
    G: int
    dtype: str  # of the output
    block_q: int
    block_k: int
    heads: int  # kv heads (of all batch entries, B*K) per tile; divides B*K

    @property
    def groups(self) -> int:
        """Head groups: tiles per (query block, key block) pair."""
        return self.B * self.K // self.heads


class _Schedule(NamedTuple):
    """Per query block, the non-empty key blocks in visiting order.

    ``index[i, t]`` is the t-th key block of query block i and ``kind[i, t]`` its
    ``BlockKind`` (FULL or PARTIAL) for ``t < count[i]``; later entries are unused.
    """

    index: jax.Array  # [nq, W] int32
    kind: jax.Array  # [nq, W] int32
    count: jax.Array  # [nq] int32


class _Aux(NamedTuple):
    """Integer inputs of the kernels (no gradients), blocked like q and k."""

    schedule: _Schedule
    q_pos: jax.Array  # [nq, B, Cq] int32
    kv_pos: jax.Array  # [nk, B, Ck] int32
    kv_valid: jax.Array  # [nk, Ck] bool: False on padding keys
    q_seg: jax.Array | None  # [nq, B, Cq] int32
    kv_seg: jax.Array | None  # [nk, B, Ck] int32


def blockwise_attention(
    q,
    k,
    v,
    *,
    mask: Mask | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    return_lse: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sink_logits=None,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
):
    """Softmax attention computed block by block, never materializing ``[T,S]``.

    Computes exactly ``attn.dot_product_attention``'s function (same masks,
    positions, segment ids, soft-cap and learned sink logits; a query with no visible
    key gets zeros and zero gradients), with memory linear in T and S in the forward
    and the backward pass, and work proportional to the non-empty blocks of the mask.

    Args:
      q: ``[B,T,N,H]`` queries.
      k: ``[B,S,K,H]`` keys, ``N % K == 0`` (MHA, GQA, MQA; K/V are never repeated).
      v: ``[B,S,K,E]`` values.
      mask: an ``attn.masks.Mask`` on absolute positions; None is bidirectional.
      block_q: query rows per block (C of the query tiles); any T works.
      block_k: keys per block; any S works.
      return_lse: also return the float32 log-sum-exp ``[B,T,N]`` (``-inf`` for a
        row that sees nothing), so partial results can be merged with
        ``attn.merge.merge_attention``.
      scale: logit scale, default ``1/sqrt(H)``.
      softcap: if given, logits become ``softcap * tanh(logits / softcap)``.
      sink_logits: ``[N]`` learned per-head logits that join the softmax
        denominator without contributing a value.
      q_positions: ``[T]`` or ``[B,T]`` ints, default ``arange(T) + S - T`` (the
        last T key positions; see ``attn.dot_product_attention``).
      kv_positions: ``[S]`` or ``[B,S]`` ints, default ``arange(S)``.
      q_segment_ids, kv_segment_ids: ``[B,T]``, ``[B,S]`` ints (both or neither);
        queries see only keys with the same id.

    Returns:
      ``out [B,T,N,E]`` in q's dtype, and ``lse [B,T,N]`` float32 if ``return_lse``.
    """
    st, aux, sink = _prepare(
        q,
        k,
        v,
        block_q,
        block_k,
        mask=mask,
        scale=scale,
        softcap=softcap,
        sink_logits=sink_logits,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    out, lse = _flash(st, *_tiles(st, q, k, v), sink, aux)
    out = _untile(st, out)
    return (out, _untile(st, lse[..., None])[..., 0]) if return_lse else out


def count_blocks(
    q,
    k,
    v,
    *,
    mask: Mask | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
) -> BlockCounts:
    """Runs the forward pass of ``blockwise_attention`` and counts the block pairs it computes.

    The counts come from counters carried by the kernel's own loops, so they show
    what is computed, not what the schedule promises. Arguments as in
    ``blockwise_attention``; under ``jit`` the counts are int32 arrays.
    """
    st, aux, sink = _prepare(
        q,
        k,
        v,
        block_q,
        block_k,
        mask=mask,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    n_full, n_partial = _count_tiles(st, q, k, v, sink, aux)
    # The loop counts tiles; each block pair is one tile per head group.
    n_full, n_partial = n_full // st.groups, n_partial // st.groups
    total = _num_blocks(st.T, st.block_q) * _num_blocks(st.S, st.block_k)
    if isinstance(n_full, jax.core.Tracer):  # under jit: the counts are arrays
        return BlockCounts(n_full, n_partial, total)
    return BlockCounts(int(n_full), int(n_partial), total)


@functools.partial(jax.jit, static_argnums=0)
def _count_tiles(st: _Static, q, k, v, sink, aux: _Aux):
    """The forward pass's tile counters (compiled as one program, not op by op)."""
    *_, counts = _forward(st, *_tiles(st, q, k, v), sink, aux)
    return counts


# ----------------------------------------------------------------------------
# Configuration, layout and schedule.


def _prepare(q, k, v, block_q, block_k, **kwargs) -> tuple[_Static, _Aux, jax.Array]:
    """Checks a call; returns its static configuration, integer inputs and ``[K,G]`` sink logits."""
    c = check_call(q, k, v, **kwargs)
    if (c.q_segment_ids is None) != (c.kv_segment_ids is None):
        fail("q_segment_ids/kv_segment_ids", "both or neither", "only one of them")
    st = _static(c, block_q, block_k, q.dtype)
    raw = [kwargs.get(name) for name in ("q_positions", "kv_positions")]
    raw += [kwargs.get(name) for name in ("q_segment_ids", "kv_segment_ids")]
    aux = _aux(st, c, raw)
    sink = c.sink_logits if st.has_sink else jnp.zeros((c.dims.K, c.dims.G), jnp.float32)
    return st, aux, sink


def _static(c, block_q, block_k, dtype) -> _Static:
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1:
            fail(name, "a positive int", repr(b))
    d = c.dims
    # A block longer than the sequence only adds padding.
    bq, bk = int(min(block_q, d.T)), int(min(block_k, d.S))
    return _Static(
        mask=c.mask,
        scale=c.scale,
        softcap=c.softcap,
        has_sink=c.sink_logits is not None,
        has_segments=c.q_segment_ids is not None,
        T=d.T,
        S=d.S,
        B=d.B,
        K=d.K,
        G=d.G,
        dtype=jnp.dtype(dtype).name,
        block_q=bq,
        block_k=bk,
        heads=_heads_per_tile(d.B * d.K, d.G * bq * bk),
    )


def _heads_per_tile(heads: int, scores_per_head: int) -> int:
    """The most kv heads (a divisor of ``heads``) whose tile holds <= ``TILE_SCORES`` scores."""
    fit = max(1, TILE_SCORES // scores_per_head)
    return max(d for d in range(1, heads + 1) if heads % d == 0 and d <= fit)


def _num_blocks(length: int, block: int) -> int:
    return -(-length // block)


def _pad_rows(x, length: int, block: int, mode: str):
    """Pads axis 1 of ``[B, L, ...]`` to a whole number of blocks."""
    pad = _num_blocks(length, block) * block - length
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


def _tiles(st: _Static, q, k, v):
    """Blocked operands of the kernels, 3-D per tile so tiles are plain matmul batches.

    Returns scaled q ``[groups*nq, heads, G*Cq, H]``, kT ``[groups*nk, heads, H, Ck]``
    and v ``[groups*nk, heads, Ck, E]``: tile ``g*nq + i`` holds query block i of
    the g-th group of ``st.heads`` kv heads (batch entries and kv heads flattened,
    B*K in all). The G query heads sharing a kv head are stacked as rows, so GQA
    needs no repeated K/V. Keys are stored transposed because ``q @ kT`` is the
    plain product XLA:CPU runs fastest. Padding rows and keys are zeros (padding
    keys are also masked).
    """
    B, T, N, H = q.shape
    K, G = st.K, N // st.K
    q = _pad_rows(_scaled(q, st.scale), T, st.block_q, "constant")
    q = q.reshape(B, -1, st.block_q, K, G, H).transpose(0, 3, 1, 4, 2, 5)  # [B,K,nq,G,Cq,H]
    q = q.reshape(B * K, -1, G * st.block_q, H)
    q, kT, v = _group(st, q), _kv_tiles(st, k).swapaxes(-1, -2), _kv_tiles(st, v)
    chex.assert_shape(q, (None, st.heads, G * st.block_q, H))
    chex.assert_shape(kT, (None, st.heads, H, st.block_k))
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


def _kv_tiles(st: _Static, x):
    """``[B,S,K,H]`` -> ``[groups*nk, heads, Ck, H]``."""
    B, S, K, H = x.shape
    x = _pad_rows(x, S, st.block_k, "constant")
    x = x.reshape(B, -1, st.block_k, K, H).transpose(0, 3, 1, 2, 4)  # [B,K,nk,Ck,H]
    return _group(st, x.reshape(B * K, -1, st.block_k, H))


def _group(st: _Static, x):
    """Per kv head ``[B*K, nb, ...]`` -> per tile ``[groups*nb, heads, ...]``."""
    nb = x.shape[1]
    x = x.reshape(st.groups, st.heads, nb, *x.shape[2:]).swapaxes(1, 2)
    return x.reshape(st.groups * nb, st.heads, *x.shape[3:])


def _ungroup(st: _Static, x):
    """Inverse of ``_group``: ``[groups*nb, heads, ...]`` -> ``[B*K, nb, ...]``."""
    x = x.reshape(st.groups, -1, st.heads, *x.shape[2:]).swapaxes(1, 2)
    return x.reshape(st.B * st.K, -1, *x.shape[3:])


def _untile(st: _Static, x):
    """Query tiles ``[groups*nq, heads, G*Cq, E]`` -> ``[B, T, N, E]`` (padding rows dropped)."""
    E = x.shape[-1]
    x = _ungroup(st, x).reshape(st.B, st.K, -1, st.G, st.block_q, E)
    x = x.transpose(0, 2, 4, 1, 3, 5)  # [B,nq,Cq,K,G,E]
    return x.reshape(st.B, -1, st.K * st.G, E)[:, : st.T]


def _head_rows(st: _Static, x, length: int, block: int):
    """Integer ``[B, L]`` (positions, segment ids) -> per tile ``[groups*nb, heads, C]``.

    Padding repeats the last entry, which keeps every block's min/max, and so
    the block classification, that of its real rows.
    """
    x = _pad_rows(x, length, block, "edge")
    x = jnp.broadcast_to(x[:, None], (st.B, st.K, x.shape[1]))
    return _group(st, x.reshape(st.B * st.K, -1, block))


def _aux(st: _Static, c, raw) -> _Aux:
    """Per-tile positions, segment ids and padding, and the schedule (see module doc)."""
    nq, nk = _num_blocks(st.T, st.block_q), _num_blocks(st.S, st.block_k)
    kv_valid = (np.arange(nk * st.block_k) < st.S).reshape(nk, st.block_k)
    rows = [(c.q_positions, st.T, st.block_q), (c.kv_positions, st.S, st.block_k)]
    if st.has_segments:
        rows += [(c.q_segment_ids, st.T, st.block_q), (c.kv_segment_ids, st.S, st.block_k)]
    if not any(isinstance(x, jax.core.Tracer) for x in raw):
        # Known when tracing (default arange positions, or concrete arrays): a NumPy schedule.
        xp, values = np, []
        offsets = [st.S - st.T, 0, 0, 0][: len(rows)]  # default queries: the last T keys
        for x, (_, length, _), offset in zip(raw[: len(rows)], rows, offsets, strict=True):
            x = default_positions(length, offset) if x is None else np.asarray(x)
            values.append(np.broadcast_to(x, (st.B, length)).astype(np.int64))
    else:  # traced positions or segment ids: the schedule is decided at run time
        xp, values = jnp, [x for x, _, _ in rows]
    bounds = [_bounds(xp, x, n, block) for x, (_, n, block) in zip(values, rows, strict=True)]
    kinds = _block_kinds(xp, st, *bounds)  # [nq, nk]
    width = max(int((kinds != 0).sum(1).max()), 1) if xp is np else nk
    schedule = _for_groups(st, _compact(xp, kinds, width), nq, nk)
    q_pos, kv_pos, *segs = [_head_rows(st, x, length, block) for x, length, block in rows]
    q_seg, kv_seg = segs if segs else (None, None)
    kv_valid = jnp.asarray(np.tile(kv_valid, (st.groups, 1)))
    return _Aux(schedule, q_pos, kv_pos, kv_valid, q_seg, kv_seg)


def _for_groups(st: _Static, sched: _Schedule, nq: int, nk: int) -> _Schedule:
    """Repeats the schedule of the query blocks for each head group's tiles."""
    offsets = jnp.arange(st.groups, dtype=jnp.int32)[:, None, None] * nk
    index = (offsets + sched.index[None]).reshape(st.groups * nq, -1)
    return _Schedule(index, jnp.tile(sched.kind, (st.groups, 1)), jnp.tile(sched.count, st.groups))


def _bounds(xp, x, length: int, block: int):
    """``[B, L]`` -> per block (lo ``[nb]``, hi ``[nb]``), over the batch and the block."""
    pad = _num_blocks(length, block) * block - length
    x = xp.pad(x, ((0, 0), (0, pad)), mode="edge").reshape(x.shape[0], -1, block)
    return x.min(axis=(0, 2)), x.max(axis=(0, 2))


def _block_kinds(xp, st: _Static, q_b, k_b, q_seg_b=None, k_seg_b=None):
    """``[nq, nk]`` ``BlockKind`` of every block pair from per-block bounds."""
    (q_lo, q_hi), (k_lo, k_hi) = q_b, k_b
    nq, nk = q_lo.shape[0], k_lo.shape[0]
    kinds = st.mask.classify(q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :])
    kinds = xp.broadcast_to(xp.asarray(kinds, dtype=xp.int32), (nq, nk))
    empty, full = kinds == BlockKind.EMPTY, kinds == BlockKind.FULL
    if st.has_segments:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg_b, k_seg_b
        qs_lo, qs_hi, ks_lo, ks_hi = qs_lo[:, None], qs_hi[:, None], ks_lo[None, :], ks_hi[None, :]
        # Disjoint id ranges share no id; one id on both sides matches everywhere.
        empty = empty | (qs_hi < ks_lo) | (ks_hi < qs_lo)
        full = full & (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
    if st.S % st.block_k:  # the last key block holds padding, which must be masked
        full = full & (xp.arange(nk) < nk - 1)[None, :]
    return xp.where(empty, BlockKind.EMPTY, xp.where(full, BlockKind.FULL, BlockKind.PARTIAL))


def _compact(xp, kinds, width: int) -> _Schedule:
    """Moves each query block's non-empty key blocks to the front, in key order."""
    nonempty = kinds != BlockKind.EMPTY
    if xp is np:
        order = np.argsort(~nonempty, axis=1, kind="stable")
    else:
        order = jnp.argsort(~nonempty, axis=1, stable=True)
    index = order[:, :width]
    kind = xp.take_along_axis(kinds, index, axis=1)
    count = nonempty.sum(1)
    return _Schedule(
        jnp.asarray(index, jnp.int32), jnp.asarray(kind, jnp.int32), jnp.asarray(count, jnp.int32)
    )


# ----------------------------------------------------------------------------
# Kernels. A tile is a (query block, key block) pair for a group of kv heads
# (st.heads of the B*K heads of all batch entries), as 3-D matmul batches. In the
# einsums K is the tile's kv heads, C its M = G*Cq query rows (the G query heads
# of each kv head stacked) and c its Ck keys:
#   forward:  q [K,C,H] @ kT [K,H,c] -> scores [K,C,c];  p [K,C,c] @ v [K,c,E]
#   backward: k [K,c,H] @ qT [K,H,C] -> transposed scores [K,c,C]
# Every matmul is a plain (row-major x row-major) product: XLA:CPU runs products
# with a transposed left operand several times slower, so the backward works on
# transposed tiles (keys as rows), where dV, dK and dQ^T are all plain products.
# Tiles are kept 3-D: with unit B or G axes XLA:CPU inserts a copy of every
# score tile between the matmul and the reductions.


def _tile_mask(st: _Static, aux: _Aux, q_pos_i, q_seg_i, j, keys_major: bool):
    """Boolean visibility of tile (i, j): ``[heads, M, Ck]``, or ``[heads, Ck, M]`` keys-major."""
    k_seg_j = None if aux.kv_seg is None else aux.kv_seg[j]
    ok = visible(st.mask, q_pos_i, aux.kv_pos[j], q_seg_i, k_seg_j)
    ok = ok & aux.kv_valid[j][None, None, :]  # [heads,Cq,Ck]
    h, Cq, Ck = ok.shape
    if keys_major:  # the G query heads of a kv head share its visibility
        ok = jnp.broadcast_to(ok.transpose(0, 2, 1)[:, :, None, :], (h, Ck, st.G, Cq))
        return ok.reshape(h, Ck, st.G * Cq)
    return jnp.broadcast_to(ok[:, None], (h, st.G, Cq, Ck)).reshape(h, st.G * Cq, Ck)


def _cap(st: _Static, s):
    """The soft-cap on (pre-scaled) float32 logits, when there is one."""
    return s if st.softcap is None else st.softcap * jnp.tanh(s / st.softcap)


def _cap_grad(st: _Static, x):
    """d cap(s) / d s from the capped logits x: ``1 - tanh^2``, or None without a cap."""
    if st.softcap is None:
        return None
    t = x / st.softcap
    return 1.0 - t * t


def _visit(index, kind, count, tile, combine, carry):
    """Folds the ``count`` scheduled key blocks of one query block into ``carry``.

    For key block ``j``, ``tile(j, masked)`` computes the tile's contribution and
    ``combine(carry, j, full, contribution)`` adds it. ``masked`` is static:
    FULL tiles run a variant that never evaluates the mask. Only the small
    per-tile results cross the ``lax.cond``; big loop-carried buffers passed
    through it would be copied on every step.
    """

    def body(t, carry):
        j, full = index[t], kind[t] == BlockKind.FULL
        unmasked = functools.partial(tile, masked=False)
        masked = functools.partial(tile, masked=True)
        return combine(carry, j, full, lax.cond(full, unmasked, masked, j))

    return lax.fori_loop(0, count, body, carry)


def _sink_rows(st: _Static, sink):
    """Sink logits ``[K,G]`` as per-row values of each head group: ``[groups, heads, M]``."""
    rows = jnp.broadcast_to(sink[None, :, :, None], (st.B, st.K, st.G, st.block_q))
    return rows.reshape(st.groups, st.heads, st.G * st.block_q)


def _forward(st: _Static, q, kT, v, sink, aux: _Aux):
    """Online softmax over the schedule.

    Args:
      q: ``[groups*nq, heads, M, H]`` query tiles, already multiplied by the logit scale.
      kT: ``[groups*nk, heads, H, Ck]`` key tiles, transposed; v: ``[groups*nk, heads, Ck, E]``.
      sink: float32 ``[K,G]`` (ignored unless ``st.has_sink``); aux: integer inputs.

    Returns:
      ``out [groups*nq, heads, M, E]`` in the input dtype, ``lse [groups*nq, heads, M]``
      float32 and the counts ``(full, partial)`` of tiles computed.
    """
    n_tiles, h, M, _ = q.shape
    E = v.shape[-1]
    sink_rows = _sink_rows(st, sink)

    def q_block(counts, xs):
        q_i, group, q_pos_i, q_seg_i, index, kind, count = xs

        def tile(j, masked):
            s = jnp.einsum("KCH,KHc->KCc", q_i, kT[j], preferred_element_type=jnp.float32)
            s = _cap(st, s)
            if masked:
                ok = _tile_mask(st, aux, q_pos_i, q_seg_i, j, keys_major=False)
                s = jnp.where(ok, s, MASKED)
            m_j = s.max(-1)
            # Masked logits give exp(MASKED - m_j) = 0, except in rows with no
            # visible key in this tile (m_j = MASKED): those are zeroed per row below.
            p = jnp.exp(s - m_j[..., None])
            l_j = p.sum(-1)
            pv = jnp.einsum(
                "KCc,KcE->KCE", p.astype(v.dtype), v[j], preferred_element_type=jnp.float32
            )
            if masked:
                seen = m_j > MASKED
                l_j, pv = jnp.where(seen, l_j, 0.0), jnp.where(seen[..., None], pv, 0.0)
            return m_j, l_j, pv

        def combine(state, j, full, part):
            m, l, acc, n = state
            m, l, acc = merge_unnormalized(m, l, acc, *part)
            return m, l, acc, n + jnp.stack([full, ~full]).astype(jnp.int32)

        if st.has_sink:  # the sink is one more logit with no value: max = sink, sum = 1
            m0, l0 = sink_rows[group], jnp.ones((h, M), jnp.float32)
        else:
            m0, l0 = jnp.full((h, M), MASKED, jnp.float32), jnp.zeros((h, M), jnp.float32)
        state = (m0, l0, jnp.zeros((h, M, E), jnp.float32), jnp.zeros(2, jnp.int32))
        m, l, acc, n = _visit(index, kind, count, tile, combine, state)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        return counts + n, (out.astype(st.dtype), lse)

    groups = jnp.arange(n_tiles) // (n_tiles // st.groups)  # head group of each query tile
    xs = (q, groups, aux.q_pos, aux.q_seg, *aux.schedule)
    counts, (out, lse) = lax.scan(q_block, jnp.zeros(2, jnp.int32), xs)
    return out, lse, (counts[0], counts[1])


def _backward(st: _Static, q, kT, v, sink, aux: _Aux, out, lse, d_out, d_lse):
    """FlashAttention-2 backward, recomputing each tile's probabilities from the lse.

    Arguments as ``_forward``'s, plus its outputs and their cotangents. Returns
    ``(dq, dkT, dv, dsink)`` in the layouts of q, kT, v (and ``[K,G]`` or None).
    """
    _, h, M, H = q.shape
    k = kT.swapaxes(-1, -2)  # [groups*nk, heads, Ck, H]
    qT = q.swapaxes(-1, -2)  # [groups*nq, heads, H, M]
    # D = rowsum(dO * O), less the lse cotangent: d lse / d logit = P, so both
    # enter dS = P * (dP - D + d_lse) the same way.
    delta = jnp.einsum("...E,...E->...", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse
    # A row that sees nothing has lse = -inf; +inf makes its P = exp(x - inf) = 0.
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)

    def q_block(dkv, xs):
        q_i, qT_i, do_i, lse_i, delta_i, q_pos_i, q_seg_i, index, kind, count = xs
        doT_i = do_i.swapaxes(-1, -2)  # [K,E,C]
        lse_i, delta_i = lse_i[:, None], delta_i[:, None]  # [K,1,C]: one per column

        def tile(j, masked):
            sT = jnp.einsum("KcH,KHC->KcC", k[j], qT_i, preferred_element_type=jnp.float32)
            xT = _cap(st, sT)
            cap_grad = _cap_grad(st, xT)  # from the unmasked logits: finite everywhere
            if masked:  # exp(MASKED - lse) = 0: no need to mask P itself
                ok = _tile_mask(st, aux, q_pos_i, q_seg_i, j, keys_major=True)
                xT = jnp.where(ok, xT, MASKED)
            pT = jnp.exp(xT - lse_i)
            dv_j = jnp.einsum(
                "KcC,KCE->KcE", pT.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32
            )
            dpT = jnp.einsum("KcE,KEC->KcC", v[j], doT_i, preferred_element_type=jnp.float32)
            dsT = pT * (dpT - delta_i)
            if cap_grad is not None:
                dsT = dsT * cap_grad
            dsT = dsT.astype(q.dtype)
            dk_j = jnp.einsum("KcC,KCH->KcH", dsT, q_i, preferred_element_type=jnp.float32)
            dqT_j = jnp.einsum("KHc,KcC->KHC", kT[j], dsT, preferred_element_type=jnp.float32)
            return dqT_j, dk_j, dv_j

        def combine(state, j, full, part):
            dqT_i, dk, dv = state
            dqT_j, dk_j, dv_j = part
            dk = lax.dynamic_update_index_in_dim(dk, dk[j] + dk_j, j, 0)
            dv = lax.dynamic_update_index_in_dim(dv, dv[j] + dv_j, j, 0)
            return dqT_i + dqT_j, dk, dv

        dqT_i = jnp.zeros((h, H, M), jnp.float32)
        dqT_i, dk, dv = _visit(index, kind, count, tile, combine, (dqT_i, *dkv))
        return (dk, dv), dqT_i.swapaxes(-1, -2).astype(q.dtype)

    dkv0 = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    xs = (q, qT, d_out, lse, delta, aux.q_pos, aux.q_seg, *aux.schedule)
    (dk, dv), dq = lax.scan(q_block, dkv0, xs)
    dsink = None
    if st.has_sink:
        # d lse / d sink = P_sink = exp(sink - lse), so d sink = -sum_rows P_sink * (D - d_lse).
        lse, delta = (x.reshape(st.groups, -1, h, M) for x in (lse, delta))
        p_sink = jnp.exp(_sink_rows(st, sink)[:, None] - lse)
        per_row = (p_sink * delta).reshape(st.groups, -1, h, st.G, st.block_q)
        per_row = per_row.swapaxes(1, 2).reshape(st.B, st.K, -1, st.G, st.block_q)
        dsink = -per_row.sum((0, 2, 4))
    return dq, dk.swapaxes(-1, -2).astype(kT.dtype), dv.astype(v.dtype), dsink


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, kT, v, sink, aux: _Aux):
    out, lse, _ = _forward(st, q, kT, v, sink, aux)
    return out, lse


def _flash_fwd(st, q, kT, v, sink, aux):
    out, lse, _ = _forward(st, q, kT, v, sink, aux)
    return (out, lse), (q, kT, v, sink, aux, out, lse)


def _flash_bwd(st, res, cts):
    q, kT, v, sink, aux, out, lse = res
    d_out, d_lse = cts
    dq, dkT, dv, dsink = _backward(st, q, kT, v, sink, aux, out, lse, d_out, d_lse)
    chex.assert_equal_shape([dq, q])
    chex.assert_equal_shape([dkT, kT])
    chex.assert_equal_shape([dv, v])
    return dq, dkT, dv, dsink, None


_flash.defvjp(_flash_fwd, _flash_bwd)
