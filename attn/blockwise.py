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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn._checks import fail
from attn.dense import MASKED, check_call, visible
from attn.masks import BlockKind, Mask
from attn.merge import merge_unnormalized

# Default tile sizes, measured on a 2-core AVX-512 CPU (bench/attention.py,
# causal, f32, B=1, N=8, H=64, T=8192): 512 x 1024 was fastest. Smaller key
# blocks pay the per-step overhead (a loop iteration, a rescale of the
# accumulator, small matmuls) more often; bigger ones waste work on the
# diagonal of causal masks and leave the L2-sized score tile.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 1024


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
    K: int
    G: int
    dtype: str  # of the output
    block_q: int
    block_k: int


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
    positions, segment ids, soft-cap and sinks; a query with no visible key gets
    zeros and zero gradients), with memory linear in T and S in the forward and
    the backward pass, and work proportional to the non-empty blocks of the mask.

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
      q_positions: ``[T]`` or ``[B,T]`` ints, default ``arange(T)``.
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
    *_, (n_full, n_partial) = _forward(st, *_tiles(st, q, k, v), sink, aux)
    total = _num_blocks(st.T, st.block_q) * _num_blocks(st.S, st.block_k)
    if isinstance(n_full, jax.core.Tracer):  # under jit: the counts are arrays
        return BlockCounts(n_full, n_partial, total)
    return BlockCounts(int(n_full), int(n_partial), total)


# ----------------------------------------------------------------------------
# Configuration, layout and schedule.


def _prepare(q, k, v, block_q, block_k, **kwargs) -> tuple[_Static, _Aux, jax.Array]:
    """Checks a call; returns its static configuration, integer inputs and ``[K,G]`` sinks."""
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
    return _Static(
        mask=c.mask,
        scale=c.scale,
        softcap=c.softcap,
        has_sink=c.sink_logits is not None,
        has_segments=c.q_segment_ids is not None,
        T=d.T,
        S=d.S,
        K=d.K,
        G=d.G,
        dtype=jnp.dtype(dtype).name,
        # A block longer than the sequence only adds padding.
        block_q=int(min(block_q, d.T)),
        block_k=int(min(block_k, d.S)),
    )


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
    """Blocked operands of the kernels, 3-D per block so tiles are plain matmul batches.

    Returns scaled q ``[nq, B*K, G*Cq, H]``, kT ``[nk, B*K, H, Ck]`` and
    v ``[nk, B*K, Ck, E]``. Each block is contiguous with the heads ahead of the
    rows; the G query heads sharing a kv head are stacked as rows, so GQA needs
    no repeated K/V. Keys are stored transposed because ``q @ kT`` is the plain
    product XLA:CPU runs fastest. Padding rows and keys are zeros (padding keys
    are also masked).
    """
    B, T, N, H = q.shape
    K, G = st.K, N // st.K
    q = _pad_rows(_scaled(q, st.scale), T, st.block_q, "constant")
    q = q.reshape(B, -1, st.block_q, K, G, H).transpose(1, 0, 3, 4, 2, 5)
    q = q.reshape(q.shape[0], B * K, G * st.block_q, H)
    return q, _kv_tiles(k, st).swapaxes(-1, -2), _kv_tiles(v, st)


def _scaled(q, scale: float):
    """``q * scale``: folding the logit scale into q saves a pass over every score tile.

    Exact when the scale is a power of two (``1/sqrt(H)`` for H = 16, 64, 256);
    otherwise half-precision queries are kept in float32 so no rounding beyond
    float32's is added to the logits.
    """
    exact = np.log2(scale).is_integer() or jnp.finfo(q.dtype).bits >= 32
    dtype = q.dtype if exact else jnp.float32
    return (q.astype(jnp.float32) * scale).astype(dtype)


def _kv_tiles(x, st: _Static):
    """``[B,S,K,H]`` -> ``[nk, B*K, Ck, H]``."""
    B, S, K, H = x.shape
    x = _pad_rows(x, S, st.block_k, "constant")
    x = x.reshape(B, -1, st.block_k, K, H).transpose(1, 0, 3, 2, 4)
    return x.reshape(x.shape[0], B * K, st.block_k, H)


def _untile(st: _Static, x):
    """``[nq, B*K, G*Cq, E]`` -> ``[B, T, N, E]`` (padding rows dropped)."""
    nq, BK, M, E = x.shape
    B, G = BK // st.K, M // st.block_q
    x = x.reshape(nq, B, st.K, G, st.block_q, E).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(B, nq * st.block_q, st.K * G, E)[:, : st.T]


def _rows(x):
    """Per-row ``[B, K, G, Cq]`` -> ``[B*K, G*Cq]``, the row layout of a tile."""
    B, K, G, C = x.shape
    return x.reshape(B * K, G * C)


def _row_blocks(xp, x, length: int, block: int):
    """Integer ``[B, L]`` -> ``[nb, B, C]``; padding repeats the last entry.

    Repeating the last position (or segment id) keeps every block's min/max, and
    so the block classification, that of its real rows.
    """
    B = x.shape[0]
    pad = _num_blocks(length, block) * block - length
    x = xp.pad(x, ((0, 0), (0, pad)), mode="edge")
    return x.reshape(B, -1, block).transpose(1, 0, 2)


def _aux(st: _Static, c, raw) -> _Aux:
    """Blocked positions, segment ids and padding, and the schedule (see module doc)."""
    nk = _num_blocks(st.S, st.block_k)
    kv_valid = (np.arange(nk * st.block_k) < st.S).reshape(nk, st.block_k)
    rows = [(c.q_positions, st.T, st.block_q), (c.kv_positions, st.S, st.block_k)]
    if st.has_segments:
        rows += [(c.q_segment_ids, st.T, st.block_q), (c.kv_segment_ids, st.S, st.block_k)]
    blocks = [_row_blocks(jnp, x, length, block) for x, length, block in rows]
    if not any(isinstance(x, jax.core.Tracer) for x in raw):
        # Known when tracing (default arange positions, or concrete arrays): a NumPy schedule.
        bounds = []
        for x, (_, length, block) in zip(raw[: len(rows)], rows, strict=True):
            x = np.arange(length) if x is None else np.asarray(x)
            x = np.broadcast_to(x, (c.dims.B, length)).astype(np.int64)
            bounds.append(_bounds(_row_blocks(np, x, length, block)))
        kinds = _block_kinds(np, st, *bounds)
        schedule = _compact(np, kinds, width=max(int((kinds != 0).sum(1).max()), 1))
    else:  # traced positions or segment ids: the schedule is decided at run time
        kinds = _block_kinds(jnp, st, *[_bounds(b) for b in blocks])
        schedule = _compact(jnp, kinds, width=nk)
    q_pos, kv_pos, *segs = blocks
    q_seg, kv_seg = segs if segs else (None, None)
    return _Aux(schedule, q_pos, kv_pos, jnp.asarray(kv_valid), q_seg, kv_seg)


def _bounds(blocks):
    """``[nb, B, C]`` -> (lo ``[nb]``, hi ``[nb]``) over the batch and the block."""
    return blocks.min(axis=(1, 2)), blocks.max(axis=(1, 2))


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
# Kernels. One tile is a (query block, key block) pair for every batch entry and
# kv head at once, as 3-D matmul batches (BK = B*K, M = G*Cq rows):
#   forward:  q [BK,M,H] @ kT [BK,H,Ck] -> scores [BK,M,Ck];  p [BK,M,Ck] @ v [BK,Ck,E]
#   backward: k [BK,Ck,H] @ qT [BK,H,M] -> transposed scores [BK,Ck,M]
# Every matmul is a plain (row-major x row-major) product: XLA:CPU runs products
# with a transposed left operand several times slower, so the backward works on
# transposed tiles (keys as rows), where dV, dK and dQ^T are all plain products.
# Tiles are kept 3-D: with unit B or G axes XLA:CPU inserts a copy of every
# score tile between the matmul and the reductions.


def _tile_mask(st: _Static, aux: _Aux, q_pos_i, q_seg_i, j, keys_major: bool):
    """Boolean visibility of tile (i, j): ``[BK, M, Ck]``, or ``[BK, Ck, M]`` keys-major."""
    k_seg_j = None if aux.kv_seg is None else aux.kv_seg[j]
    ok = visible(st.mask, q_pos_i, aux.kv_pos[j], q_seg_i, k_seg_j)
    ok = ok & aux.kv_valid[j][None, None, :]  # [B,Cq,Ck]
    B, Cq, Ck = ok.shape
    G = st.G
    if keys_major:
        ok = jnp.broadcast_to(ok.transpose(0, 2, 1)[:, None, :, None, :], (B, st.K, Ck, G, Cq))
        return ok.reshape(B * st.K, Ck, G * Cq)
    ok = jnp.broadcast_to(ok[:, None, None], (B, st.K, G, Cq, Ck))
    return ok.reshape(B * st.K, G * Cq, Ck)


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


def _sink_rows(st: _Static, sink, BK: int):
    """Sink logits ``[K,G]`` as per-row values ``[BK, M]``."""
    B = BK // st.K
    return _rows(jnp.broadcast_to(sink[None, :, :, None], (B, st.K, st.G, st.block_q)))


def _forward(st: _Static, q, kT, v, sink, aux: _Aux):
    """Online softmax over the schedule.

    Args:
      q: ``[nq,BK,M,H]`` queries, already multiplied by the logit scale.
      kT: ``[nk,BK,H,Ck]`` keys, transposed per block; v: ``[nk,BK,Ck,E]``.
      sink: float32 ``[K,G]`` (ignored unless ``st.has_sink``); aux: integer inputs.

    Returns:
      ``out [nq,BK,M,E]`` in the input dtype, ``lse [nq,BK,M]`` float32 and the
      counts ``(full, partial)`` of tiles computed.
    """
    _, BK, M, _ = q.shape
    E = v.shape[-1]
    if st.has_sink:  # the sink is one more logit with no value: max = sink, sum = 1
        m0 = _sink_rows(st, sink, BK)
        l0 = jnp.ones((BK, M), jnp.float32)
    else:
        m0 = jnp.full((BK, M), MASKED, jnp.float32)
        l0 = jnp.zeros((BK, M), jnp.float32)
    acc0 = jnp.zeros((BK, M, E), jnp.float32)

    def q_block(counts, xs):
        q_i, q_pos_i, q_seg_i, index, kind, count = xs

        def tile(j, masked):
            s = jnp.einsum("BMH,BHc->BMc", q_i, kT[j], preferred_element_type=jnp.float32)
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
                "BMc,BcE->BME", p.astype(v.dtype), v[j], preferred_element_type=jnp.float32
            )
            if masked:
                seen = m_j > MASKED
                l_j, pv = jnp.where(seen, l_j, 0.0), jnp.where(seen[..., None], pv, 0.0)
            return m_j, l_j, pv

        def combine(state, j, full, part):
            m, l, acc, n = state
            m, l, acc = merge_unnormalized(m, l, acc, *part)
            return m, l, acc, n + jnp.stack([full, ~full]).astype(jnp.int32)

        state = (m0, l0, acc0, jnp.zeros(2, jnp.int32))
        m, l, acc, n = _visit(index, kind, count, tile, combine, state)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        return counts + n, (out.astype(st.dtype), lse)

    xs = (q, aux.q_pos, aux.q_seg, *aux.schedule)
    counts, (out, lse) = lax.scan(q_block, jnp.zeros(2, jnp.int32), xs)
    return out, lse, (counts[0], counts[1])


def _backward(st: _Static, q, kT, v, sink, aux: _Aux, out, lse, d_out, d_lse):
    """FlashAttention-2 backward, recomputing each tile's probabilities from the lse.

    Arguments as ``_forward``'s, plus its outputs and their cotangents. Returns
    ``(dq, dkT, dv, dsink)`` in the layouts of q, kT, v (and ``[K,G]`` or None).
    """
    nq, BK, M, H = q.shape
    nk, E, Ck = v.shape[0], v.shape[-1], kT.shape[-1]
    k = kT.swapaxes(-1, -2)  # [nk,BK,Ck,H]
    qT = q.swapaxes(-1, -2)  # [nq,BK,H,M]
    # D = rowsum(dO * O), less the lse cotangent: d lse / d logit = P, so both
    # enter dS = P * (dP - D + d_lse) the same way.
    delta = jnp.einsum("...E,...E->...", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse
    # A row that sees nothing has lse = -inf; +inf makes its P = exp(x - inf) = 0.
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)

    def q_block(dkv, xs):
        q_i, qT_i, do_i, lse_i, delta_i, q_pos_i, q_seg_i, index, kind, count = xs
        doT_i = do_i.swapaxes(-1, -2)  # [BK,E,M]
        lse_i, delta_i = lse_i[:, None], delta_i[:, None]  # [BK,1,M]: one per column

        def tile(j, masked):
            sT = jnp.einsum("BcH,BHM->BcM", k[j], qT_i, preferred_element_type=jnp.float32)
            xT = _cap(st, sT)
            cap_grad = _cap_grad(st, xT)  # from the unmasked logits: finite everywhere
            if masked:  # exp(MASKED - lse) = 0: no need to mask P itself
                ok = _tile_mask(st, aux, q_pos_i, q_seg_i, j, keys_major=True)
                xT = jnp.where(ok, xT, MASKED)
            pT = jnp.exp(xT - lse_i)
            dv_j = jnp.einsum(
                "BcM,BME->BcE", pT.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32
            )
            dpT = jnp.einsum("BcE,BEM->BcM", v[j], doT_i, preferred_element_type=jnp.float32)
            dsT = pT * (dpT - delta_i)
            if cap_grad is not None:
                dsT = dsT * cap_grad
            dsT = dsT.astype(q.dtype)
            dk_j = jnp.einsum("BcM,BMH->BcH", dsT, q_i, preferred_element_type=jnp.float32)
            dqT_j = jnp.einsum("BHc,BcM->BHM", kT[j], dsT, preferred_element_type=jnp.float32)
            return dqT_j, dk_j, dv_j

        def combine(state, j, full, part):
            dqT_i, dk, dv = state
            dqT_j, dk_j, dv_j = part
            dk = lax.dynamic_update_index_in_dim(dk, dk[j] + dk_j, j, 0)
            dv = lax.dynamic_update_index_in_dim(dv, dv[j] + dv_j, j, 0)
            return dqT_i + dqT_j, dk, dv

        dqT_i = jnp.zeros((BK, H, M), jnp.float32)
        dqT_i, dk, dv = _visit(index, kind, count, tile, combine, (dqT_i, *dkv))
        return (dk, dv), dqT_i.swapaxes(-1, -2).astype(q.dtype)

    dkv0 = (jnp.zeros((nk, BK, Ck, H), jnp.float32), jnp.zeros((nk, BK, Ck, E), jnp.float32))
    xs = (q, qT, d_out, lse, delta, aux.q_pos, aux.q_seg, *aux.schedule)
    (dk, dv), dq = lax.scan(q_block, dkv0, xs)
    dsink = None
    if st.has_sink:
        # d lse / d sink = P_sink = exp(sink - lse), so d sink = -sum_rows P_sink * (D - d_lse).
        p_sink = jnp.exp(_sink_rows(st, sink, BK)[None] - lse)  # [nq,BK,M]
        per_row = (p_sink * delta).reshape(nq, BK // st.K, st.K, st.G, st.block_q)
        dsink = -per_row.sum((0, 1, 4))
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
    return dq, dkT, dv, dsink, None


_flash.defvjp(_flash_fwd, _flash_bwd)
