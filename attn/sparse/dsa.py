"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, 2025): a lightning indexer and top-k tokens.

A small indexer scores every earlier token for each query,
``I[t,s] = sum_i w[t,i] relu(q_idx[t,i] . k_idx[s])`` (I heads of the
indexer's own dim F, one indexer key per token), and each query attends over
its ``top_k`` tokens by that score, every head the same tokens. The indexer
costs ``T x S x I x F`` (few heads, small F: the paper runs it in FP8); the
attention reads ``top_k`` keys per query.

The selection ranks ``indexer_scores``: the same sum on 8-bit operands (the
paper runs its indexer in FP8), computed exactly, so a score is the same bits
whatever else is in the batch, the chunk or the cache: forward, prefill and
decode rank the same values, and a row's choice never depends on its batch.
Ties go to the earlier key (the lower index: the earlier position along a
run), as ``jax.lax.top_k`` orders them.

The selection has no gradient. The paper trains the indexer on its own loss
(``indexer_loss``): the KL divergence from the main attention's distribution
(summed over heads, renormalized) to the indexer's softmax, over every token
during a dense warm-up and over the selected tokens afterwards, with the
indexer's inputs detached so the main model learns from the language loss
alone and the indexer from this loss alone.
"""

from __future__ import annotations

from typing import Unpack

import jax
import jax.numpy as jnp

from attn.checks import fail, positive_int
from attn.masks import PADDING, drop_padding
from attn.softmax.call import MASKED, CallArgs, check_call, takes_call_args
from attn.sparse import exact, gather
from attn.sparse.gather import DEFAULT_CHUNK, chunks, split, unsplit


def lightning_indexer(index_q, index_k, index_w):
    """The indexer's scores ``[B,T,S]`` float32: ``sum_i w[t,i] relu(q[t,i] . k[s])``.

    Args:
      index_q: ``[B,T,I,F]`` indexer queries (I heads of dim F).
      index_k: ``[B,S,F]`` indexer keys, one per token.
      index_w: ``[B,T,I]`` per-query head weights.
    """
    s = jnp.einsum("BTIF,BSF->BTIS", index_q, index_k, preferred_element_type=jnp.float32)
    return jnp.einsum("BTI,BTIS->BTS", index_w.astype(jnp.float32), jax.nn.relu(s))


def indexer_scores(index_q, index_k, index_w):
    """The scores the selection ranks: ``[B,T,S]`` float32, ``lightning_indexer`` on
    8-bit operands, computed exactly.

    Each indexer query (per token and head) and key (per token) is rounded to
    8 bits (``attn.sparse.exact``), so their dot products are exact; the heads
    are then summed one after another, elementwise, so nothing depends on the
    shapes around a score. Keys equal after rounding tie exactly, whatever
    rounding noise their float values carry.

    Args: as ``lightning_indexer``'s.
    """
    (qi, qs), (ki, ks) = exact.int8(index_q), exact.int8(index_k)
    dots = jnp.einsum("BTIF,BSF->BTIS", qi, ki, preferred_element_type=jnp.float32)
    w = index_w.astype(jnp.float32) * qs  # [B,T,I]: a head's weight times its query's scale
    score = jnp.zeros(dots.shape[:2] + dots.shape[3:], jnp.float32)
    for i in range(dots.shape[2]):  # a fixed order: a reduction's would follow the shapes
        score = score + w[:, :, i, None] * jax.nn.relu(dots[:, :, i])
    return score * ks[:, None, :]


def check_indexer(c, index_q, index_k, index_w) -> None:
    """Shapes of the indexer's inputs against the call's (``ValueError`` naming the argument)."""
    B, T, S = c.dims.B, c.dims.T, c.dims.S
    for name, x, rank, lead in (
        ("index_q", index_q, 4, (B, T)),
        ("index_k", index_k, 3, (B, S)),
        ("index_w", index_w, 3, (B, T)),
    ):
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) != rank or tuple(shape[:2]) != lead:
            fail(name, f"a rank-{rank} array with leading axes {lead}", shape)
    if index_k.shape[2] != index_q.shape[3] or index_w.shape[2] != index_q.shape[2]:
        fail(
            "index_k/index_w",
            f"F={index_q.shape[3]} and I={index_q.shape[2]} as index_q's",
            f"{index_k.shape} and {index_w.shape}",
        )
    exact.check_dim(index_q.shape[3], "index_q", index_q.shape)


@takes_call_args
def indexed_topk_attention(
    q,
    k,
    v,
    index_q,
    index_k,
    index_w,
    *,
    top_k: int,
    chunk: int = DEFAULT_CHUNK,
    return_lse: bool = False,
    **call_args: Unpack[CallArgs],
):
    """DSA: every head of a query attends over the query's ``top_k`` tokens by the indexer.

    Args:
      q: ``[B,T,N,H]``; k: ``[B,S,K,H]``; v: ``[B,S,K,E]``.
      index_q, index_k, index_w: the indexer's inputs (``lightning_indexer``).
      top_k: tokens per query; at least S reads every visible key (dense attention).
      chunk: queries per step (the indexer's memory is ``chunk x S``).
      return_lse: also return the float32 log-sum-exp ``[B,T,N]``.
      **call_args: the call's (``attn.softmax.call.CallArgs``); the indexer ranks only
        the keys the mask and segments let the query see. No bias or mask array.

    Returns:
      ``out [B,T,N,E]`` (and the lse).
    """
    c = _check(q, k, v, index_q, index_k, index_w, call_args, "indexed_topk_attention")
    top_k, chunk = positive_int(top_k, "top_k"), positive_int(chunk, "chunk")
    out, lse = _dsa(c, q, k, v, index_q, index_k, index_w, top_k=top_k, chunk=chunk)
    return (out, lse) if return_lse else out


def _check(q, k, v, index_q, index_k, index_w, call_args, where):
    c = check_call(q, k, v, **call_args)
    c.refuse_pairs(where)
    check_indexer(c, index_q, index_k, index_w)
    return c


@gather.jit_static("top_k", "chunk")
def _dsa(c, q, k, v, index_q, index_k, index_w, *, top_k, chunk):
    start, stop = indexer_topk(c, index_q, index_k, index_w, top_k=top_k, chunk=chunk)
    return gather.gathered_attention(c, q, k, v, start, stop, block=1, chunk=chunk)


def indexer_topk(c, index_q, index_k, index_w, *, top_k: int, chunk: int = DEFAULT_CHUNK):
    """Each query's ``top_k`` visible tokens by the indexer: ``(start, stop)`` ``[B,T,1,n]``.

    Ranks ``indexer_scores`` (the same bits in any batch, chunk or cache); ties go
    to the earlier key. ``stop = start + 1`` for a chosen token, ``start`` where
    the query sees fewer than ``top_k`` keys; ``n = min(top_k, S)``. Not
    differentiated.
    """
    T, S = c.dims.T, c.dims.S
    n = min(top_k, S)
    C, _ = chunks(T, chunk)
    index_q, index_k, index_w = jax.lax.stop_gradient(_isolate(c, index_q, index_k, index_w))

    def one(xs):
        iq, iw, pos, seg = xs
        score = indexer_scores(iq, index_k, iw)
        score = jnp.where(visible(c, pos, seg), score, -jnp.inf)
        top, s = jax.lax.top_k(score, n)  # [B,C,n]
        s = s.astype(jnp.int32)
        return s[:, :, None], jnp.where(top > -jnp.inf, s + 1, s)[:, :, None]

    seg = None if c.q_segment_ids is None else split(c.q_segment_ids, C, PADDING)
    start, stop = jax.lax.map(
        one, (split(index_q, C), split(index_w, C), split(c.q_positions, C), seg)
    )
    return unsplit(start, T), unsplit(stop, T)


def _isolate(c, index_q, index_k, index_w):
    """The indexer's inputs with padding tokens' entries zeroed (``Call.isolate``)."""
    q_seg, kv_seg = c.q_segment_ids, c.kv_segment_ids
    return drop_padding(index_q, q_seg), drop_padding(index_k, kv_seg), drop_padding(index_w, q_seg)


def visible(c, q_pos, q_seg):
    """``[B,C,S]``: which keys a chunk of queries sees (mask and segments)."""
    ok = c.mask.allowed(q_pos, c.kv_positions)
    if q_seg is not None:
        kv = c.kv_segment_ids[:, None, :]
        ok &= (q_seg[:, :, None] == kv) & (kv != PADDING)
    return ok


@takes_call_args
def indexer_loss(
    q,
    k,
    index_q,
    index_k,
    index_w,
    *,
    top_k: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    **call_args: Unpack[CallArgs],
):
    """DSA's indexer loss: ``KL(p || softmax(I))`` per query, averaged over queries that see
    a key.

    ``p`` is the main attention's distribution over the same tokens, summed over
    its heads and renormalized, with no gradient (q and k are detached); the
    loss trains only ``index_q``, ``index_k`` and ``index_w``.

    Args:
      q: ``[B,T,N,H]``; k: ``[B,S,K,H]`` (the main attention's).
      index_q, index_k, index_w: the indexer's inputs.
      top_k: the tokens both distributions are taken over: each query's ``top_k`` by the
        indexer (sparse training), or None for every visible token (dense warm-up).
      **call_args: the main attention's call (scale, soft-cap, score modifier, mask, ...).

    Returns:
      A float32 scalar.
    """
    c = _check(q, k, k[..., :1], index_q, index_k, index_w, call_args, "indexer_loss")
    top_k = c.dims.S if top_k is None else positive_int(top_k, "top_k")
    return _indexer_loss(
        c, q, k, index_q, index_k, index_w, top_k=top_k, chunk=positive_int(chunk, "chunk")
    )


@gather.jit_static("top_k", "chunk")
def _indexer_loss(c, q, k, index_q, index_k, index_w, *, top_k, chunk):
    B, T, S, _, K, G, _, _ = c.dims
    q, k = jax.lax.stop_gradient(c.isolate(q, k, k)[:2])
    index_q, index_k, index_w = _isolate(c, index_q, index_k, index_w)
    C, n = chunks(T, chunk)
    q_seg = None if c.q_segment_ids is None else split(c.q_segment_ids, C, PADDING)
    dense = top_k >= S  # every visible token: the keys are gathered once per chunk
    if dense:
        start = jnp.zeros((n, B, C, K, 1, 1), jnp.int32)  # unused: every chunk reads all
        stop = start
    else:
        start, stop = indexer_topk(c, index_q, index_k, index_w, top_k=top_k, chunk=chunk)
        start, stop = gather.per_kv_head(start, K, G), gather.per_kv_head(stop, K, G)
        start, stop = split(start, C), split(stop, C)
    every = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, 1, K, 1, S))

    @jax.checkpoint
    def one(xs):
        qc, lo, hi, iq, iw, pos, seg, t0 = xs
        lo, real = (every, True) if dense else (lo, hi > lo)  # [B,C|1,K,1,M]
        s, ok = gather.logits(c, qc, k, lo, real, (pos, seg, t0))
        p = jnp.where(ok, jax.nn.softmax(jnp.where(ok, s, MASKED), axis=-1), 0.0)
        p = p.sum((2, 3))  # [B,C,M]: summed over heads
        total = p.sum(-1, keepdims=True)
        p = p / jnp.where(total > 0, total, 1.0)
        if dense:
            score = jnp.einsum("BCIF,BMF->BCIM", iq, index_k, preferred_element_type=jnp.float32)
        else:
            kx = index_k[jnp.arange(B)[:, None, None], lo[:, :, 0, 0]]  # [B,C,M,F]
            score = jnp.einsum("BCIF,BCMF->BCIM", iq, kx, preferred_element_type=jnp.float32)
        score = jnp.einsum("BCI,BCIM->BCM", iw.astype(jnp.float32), jax.nn.relu(score))
        seen = jnp.broadcast_to(ok, s.shape)[:, :, 0, 0]
        log_q = jax.nn.log_softmax(jnp.where(seen, score, MASKED), axis=-1)  # finite
        log_p = jnp.log(jnp.where(p > 0, p, 1.0))
        kl = jnp.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
        return kl, total[..., 0] > 0

    xs = (
        split(q, C),
        start,
        stop,
        split(index_q, C),
        split(index_w, C),
        split(c.q_positions, C),
        q_seg,
        jnp.arange(n) * C,
    )
    kl, counted = jax.lax.map(one, xs)
    kl, counted = unsplit(kl, T), unsplit(counted, T)
    return jnp.sum(jnp.where(counted, kl, 0.0)) / jnp.maximum(counted.sum(), 1)
