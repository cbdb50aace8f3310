"""Mixture of Block Attention (MoBA; Lu et al. 2025, Kimi).

Each sequence is cut into blocks of ``block_size`` positions. A query head
scores each block by its query against the block's mean key, reads the
``top_k`` best blocks whole, and softmax attends over the keys it read; the
block holding the query is always one of them (the paper forces it and masks
it causally). The selection has no parameters and no gradient: MoBA trains
nothing in its gate, the keys learn to be selected through the attention
they receive.

Our reading of the paper's causal rule, in terms of any mask: a block is
scored only when the query sees every key in it (a block with a hidden key
would leak that key into the choice through its mean); its own block, then
the blocks it sees in part (the one a window's edge cuts), are read first,
whatever their means, so ``top_k=1`` reads the own block. Under ``causal()`` that is the
paper's rule: earlier blocks compete, the current one is kept. With
``top_k`` at least the number of blocks every visible key is read, and MoBA
is dense attention under the same mask. Blocks never cross a segment: packed
sequences choose among their own blocks only.

The gate is ``q . mean(k)`` in float32, as the paper and its naive code score
blocks, summed in one fixed order (``attn.sparse.exact.tree_dot``), and a
block's sum is its keys summed in one fixed order over the block's slots
(``attn.sparse.exact.tree_sum``): a forward pass, prefill chunks and decode
steps, whose matmuls would otherwise sum in orders their shapes choose, compute
the same bits, so ties and near ties (a few ulps) resolve alike in all of
them, ties to the earlier block (``jax.lax.top_k``'s order). On whole arrays
each key holds its block's sum (``block_key_sums``); a decode cache keeps each
new key's block sum so far (``window_key_sums``): at a block's last key, the
one the gate reads, the two are the same bits.

Cost: the gate reads one mean per block (``T x S/block_size`` scores), the
attention ``top_k x block_size`` keys per query and head, never ``T x S``.
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp

from attn.checks import fail, positive_int
from attn.masks import BlockKind, drop_padding
from attn.softmax.call import CallArgs, check_call, takes_call_args
from attn.sparse import exact, gather, layout
from attn.sparse import pallas as sparse_pallas
from attn.sparse.gather import DEFAULT_CHUNK, chunks, split, unsplit


@takes_call_args
def moba_attention(
    q,
    k,
    v,
    *,
    block_size: int,
    top_k: int,
    chunk: int = DEFAULT_CHUNK,
    return_lse: bool = False,
    impl: str = "gather",
    platform: str | None = None,
    interpret: bool | None = None,
    key_sums=None,
    **call_args: Unpack[CallArgs],
):
    """MoBA: each query head attends over its ``top_k`` blocks (module docstring).

    Args:
      q: ``[B,T,N,H]``; k: ``[B,S,K,H]``; v: ``[B,S,K,E]`` (GQA: a query head scores
        its kv head's blocks).
      block_size: positions per block.
      top_k: blocks read per query and head, its own block included; ``top_k``
        at least the number of blocks reads every visible key (dense attention).
      chunk: queries per step (memory ``chunk x`` what one query reads).
      return_lse: also return the float32 log-sum-exp ``[B,T,N]`` (``impl="gather"``).
      impl: ``"gather"`` (XLA: the selected keys gathered per query, any call) or
        ``"pallas"`` (``attn.sparse.pallas``: a block-sparse kernel over each query block's
        selected blocks; default positions, no segments, modifiers or sinks).
      platform, interpret: the Pallas kernel's (``attn.sparse.pallas.block_sparse_attention``;
        on a CPU it runs only with ``interpret=True``).
      key_sums: ``[B,S,K,H]`` float32, what a decode cache keeps (``window_key_sums``): at
        each block's last key, the block's sum (``block_key_sums``; other keys are not
        read); None computes them from k.
      **call_args: the call's (``attn.softmax.call.CallArgs``); default mask
        ``full()`` as everywhere, so pass ``masks.causal()`` for a decoder.
        No bias or boolean mask array (a ``ValueError``).

    Returns:
      ``out [B,T,N,E]`` (and the lse).
    """
    c = check_call(q, k, v, **call_args)
    c.refuse_pairs("moba_attention")
    layout.check_runs(c)
    block_size, top_k = positive_int(block_size, "block_size"), positive_int(top_k, "top_k")
    chunk = positive_int(chunk, "chunk")
    sparse_pallas.check_impl(c, impl, platform, interpret, return_lse, "moba_attention")
    if key_sums is not None and getattr(key_sums, "shape", None) != k.shape:
        fail("key_sums", f"shape {k.shape}, as k's", getattr(key_sums, "shape", key_sums))
    out, lse = _moba(c, q, k, v, key_sums, block_size=block_size, top_k=top_k, chunk=chunk,
                     impl=impl, platform=platform, interpret=interpret)  # fmt: skip
    return (out, lse) if return_lse else out


@gather.jit_static("block_size", "top_k", "chunk", "impl", "platform", "interpret")
def _moba(c, q, k, v, key_sums, *, block_size, top_k, chunk, impl, platform, interpret):
    start, stop = moba_select(c, q, k, block_size=block_size, top_k=top_k, chunk=chunk,
                              key_sums=key_sums)  # fmt: skip
    if impl == "pallas":
        ids = sparse_pallas.block_ids(start, stop, block_size)
        out = sparse_pallas.block_sparse_attention(
            c, q, k, v, ids, block=block_size, platform=platform, interpret=interpret
        )
        return out, None
    return gather.gathered_attention(c, q, k, v, start, stop, block=block_size, chunk=chunk)


def moba_select(c, q, k, *, block_size: int, top_k: int, chunk: int = DEFAULT_CHUNK,
                key_sums=None):  # fmt: skip
    """The blocks each query head reads: ``(start, stop)`` ``[B,T,N,top_k]`` key index ranges.

    Not differentiated (the selection is discrete). ``stop <= start`` where a
    query has fewer than ``top_k`` blocks to read. A block's mean key is its
    last key's block sum (``key_sums``, or ``block_key_sums``) over its length.
    """
    B, T, S, N, K, G, H, _ = c.dims
    q, k, _ = c.isolate(q, k, k)
    runs = layout.locate(c)
    if key_sums is None:
        key_sums = block_key_sums(k, block_size, kv_positions=c.kv_positions,
                                  kv_segment_ids=c.kv_segment_ids)  # fmt: skip
    sums = jax.lax.stop_gradient(drop_padding(key_sums, c.kv_segment_ids))
    J = layout.max_blocks(S, block_size)
    n = min(top_k, J)
    C, _ = chunks(T, chunk)

    def means(blk):  # [B,C|1,M,K,H]: each candidate block's mean key
        last = jnp.clip(blk.stop - 1, 0, S - 1)
        count = jnp.maximum(blk.stop - blk.start, 1).astype(jnp.float32)[..., None, None]
        return sums[jnp.arange(B)[:, None, None], last].astype(jnp.float32) / count

    # Without segment ids every query's run is the whole row: its blocks, and their means,
    # are the same for all queries, so they are gathered once rather than per query.
    shared = None
    if c.q_segment_ids is None:
        row = layout.Runs(*(x[:, :1] for x in runs))
        shared = means(layout.blocks(c.mask, row, c.q_positions[:, :1], block_size, S))[:, 0]

    def one(xs):
        qc, pos, *rc = xs
        runs_c = layout.Runs(*rc)
        blk = layout.blocks(c.mask, runs_c, pos, block_size, S)
        gate = _gate(qc.reshape(B, -1, K, G, H), means(blk) if shared is None else shared)
        own = jnp.arange(J) == layout.own_block(runs_c, pos, block_size)[..., None]
        own &= blk.kind != int(BlockKind.EMPTY)
        # Read first: the own block, then the blocks seen in part, then the rest by gate.
        partial = (blk.kind == int(BlockKind.PARTIAL))[:, :, None, None]
        score = jnp.where((blk.kind == int(BlockKind.FULL))[:, :, None, None], gate, -jnp.inf)
        score = jnp.where(partial, jnp.finfo(jnp.float32).max, score)
        score = jnp.where(own[:, :, None, None], jnp.inf, score)
        top, j = jax.lax.top_k(jax.lax.stop_gradient(score), n)  # [B,C,K,G,n]
        pick = lambda x: jnp.take_along_axis(x[:, :, None, None], j, axis=-1)  # noqa: E731
        lo, hi = pick(blk.start), pick(blk.stop)
        hi = jnp.where(top > -jnp.inf, hi, lo)
        return lo.reshape(B, -1, N, n), hi.reshape(B, -1, N, n)

    xs = (split(q, C), split(c.q_positions, C), *(split(x, C) for x in runs))
    start, stop = jax.lax.map(one, xs)
    return unsplit(start, T), unsplit(stop, T)


def _gate(q, means):
    """The gate ``[B,C,K,G,M]``: queries ``[B,C,K,G,H]`` against block means ``[B,C,M,K,H]``
    (each query its own candidates) or ``[B,M,K,H]`` (shared), float32 dot products in one
    fixed order (``attn.sparse.exact.tree_dot``): the same bits in any chunk, batch or cache."""
    if means.ndim == 5:
        means = jnp.moveaxis(means, 2, 3)[:, :, :, None]  # [B,C,K,1,M,H]
    else:
        means = jnp.moveaxis(means, 1, 2)[:, None, :, None]  # [B,1,K,1,M,H]
    return exact.tree_dot(q[..., None, :], means)


def block_key_sums(k, block_size: int, *, kv_positions=None, kv_segment_ids=None):
    """Each key's block sum: ``[B,S,K,H]`` float32, the sum of the keys of its block.

    Blocks are ``position // block_size`` within each segment's run of keys
    (``attn.sparse.layout``), a block's keys consecutive. The sum is
    ``exact.tree_sum`` over the block's ``block_size`` slots (key ``i`` of the block in
    slot ``i``, zeros where the block has no key): ``window_key_sums`` gives a cache's
    new key the same bits once it is its block's last key.

    Args:
      k: ``[B,S,K,H]``; kv_positions, kv_segment_ids: ``[B,S]`` (default ``arange(S)``,
        one segment).
    """
    k = jnp.asarray(k)
    block_size = positive_int(block_size, "block_size")
    if k.ndim != 4:
        fail("k", "keys [B,S,K,H]", k.shape)
    B, S = k.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) if kv_positions is None
                           else jnp.asarray(kv_positions, jnp.int32), (B, S))  # fmt: skip
    ids = jnp.ones((B, S), jnp.int32) if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
    block = pos // block_size
    starts = jnp.concatenate(
        [jnp.ones((B, 1), bool), (block[:, 1:] != block[:, :-1]) | (ids[:, 1:] != ids[:, :-1])], 1
    )
    which = jnp.cumsum(starts, axis=1)  # each key's block, numbered along the row
    x = k.astype(jnp.float32)
    # exact.tree_sum over the slots, in place along the row: at width h a key adds the key
    # h after it if that key is in its block (else 0, as tree_sum adds an empty slot). After
    # the last width a block's first key holds its sum.
    for h in exact.halves(block_size):
        n = min(h, S)
        later = jnp.pad(x[:, n:], ((0, 0), (0, n), (0, 0), (0, 0)))
        same = jnp.pad(which[:, n:] == which[:, : S - n], ((0, 0), (0, n)))
        x = x + jnp.where(same[..., None, None], later, 0.0)
    first = jax.lax.cummax(jnp.where(starts, jnp.arange(S), 0), axis=1)
    return x[jnp.arange(B)[:, None], first]


def window_key_sums(windows):
    """The block sums a cache keeps for new keys: ``windows [B,T,block_size,K,H]`` holds each
    new key's block up to it (key ``i`` of the block in slot ``i``, zeros after the new
    key); returns ``[B,T,K,H]`` float32, equal to ``block_key_sums`` at a block's last key."""
    if getattr(windows, "ndim", None) != 5:
        fail("windows", "[B,T,block_size,K,H]: each new key's block in slots",
             getattr(windows, "shape", type(windows).__name__))  # fmt: skip
    return exact.tree_sum(windows, axis=2)
