"""Softmax attention over the keys each query selected: the core of every sparse method.

Each query names the key ranges it reads; they are gathered and attended to
with the call's rules (mask, segments, score modifier, soft-cap, sinks),
float32 statistics and zeros for a query that reads nothing. Memory and work
grow with T x what a query reads, never with T x S: queries are processed
``chunk`` at a time, and the backward pass recomputes each chunk's gathers
rather than storing them.

Who shares a selection: ``start``, ``stop`` ``[B,T,X,n]`` with ``X`` one of
1 (every head reads the same keys: DSA), K (a kv head's G query heads share
them: NSA) or N (each query head its own: MoBA). They are laid out as
``[B,T,K,Gs,n]`` with ``Gs`` 1 or G, so a kv head's keys are gathered once for
the query heads that share them, and never repeated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from attn import scores
from attn.checks import fail
from attn.masks import PADDING
from attn.softmax.call import MASKED, Call
from attn.sparse.layout import block_tokens

DEFAULT_CHUNK = 128


def per_kv_head(x, K: int, G: int):
    """A selection ``[B,T,X,n]`` (X = 1, K or N) as ``[B,T,K,Gs,n]``."""
    B, T, X, n = x.shape
    if X == 1:
        return jnp.broadcast_to(x[:, :, :, None], (B, T, K, 1, n))
    if X not in (K, K * G):
        fail("selection", f"1, K={K} or N={K * G} selections per token", X)
    return x.reshape(B, T, K, X // K, n)


def take(x, index):
    """Rows of ``x [B,S,K,...]`` at ``index [B,C,K,Gs,M]`` (kv head k reads its own):
    ``[B,C,K,Gs,M,...]``."""
    B, _, K = index.shape[:3]
    b = jnp.arange(B)[:, None, None, None, None]
    h = jnp.arange(K)[None, None, :, None, None]
    return x[b, index, h]


def logits(c: Call, q, k, index, real, q_rows):
    """Float32 logits ``[B,C,K,G,M]`` of a chunk of queries against their gathered keys, and
    which are visible (``[B,C,K,Gs,M]``).

    Args:
      q: ``[B,C,N,H]``; k: ``[B,S,K,H]``; index, real: ``[B,C,K,Gs,M]``, or ``[B,1,K,1,M]``
        for keys every query of the chunk reads (gathered once).
      q_rows: ``(q_pos, q_seg, t0)``: the chunk's positions and segment ids ``[B,C]`` (ids
        None without segments) and the index of its first query.
    """
    q_pos, q_seg, t0 = q_rows
    B, Ci, K, Gs, _ = index.shape
    C, G, H = q.shape[1], c.dims.G, c.dims.H
    kg = take(k, index).astype(q.dtype)  # [B,C|1,K,Gs,M,H]: float32 k (see gathered_attention)
    qg = q.reshape(B, C, K, G, H)
    f32 = jnp.float32
    if Ci == 1 and C > 1:
        s = jnp.einsum("BCKGH,BKMH->BCKGM", qg, kg[:, 0, :, 0], preferred_element_type=f32)
    elif Gs == 1:
        s = jnp.einsum("BCKGH,BCKMH->BCKGM", qg, kg[:, :, :, 0], preferred_element_type=f32)
    else:
        s = jnp.einsum("BCKGH,BCKGMH->BCKGM", qg, kg, preferred_element_type=f32)
    s = s * c.scale
    b = jnp.arange(B)[:, None, None, None, None]
    k_pos = c.kv_positions[b, index]  # [B,C,K,Gs,M]
    q_pos = q_pos[:, :, None, None, None]
    ok = real & c.mask.allowed(q_pos, k_pos)[..., 0, :]
    if q_seg is not None:
        k_seg = c.kv_segment_ids[b, index]
        ok &= (k_seg == q_seg[:, :, None, None, None]) & (k_seg != PADDING)
    return _modified(c, s, q_pos, k_pos, index, t0), ok


def _modified(c: Call, s, q_pos, k_pos, index, t0):
    """``s [B,C,K,G,M]`` through the call's modifier, its leaves gathered per query."""
    structure, leaves = scores.split(c.score)
    if structure is None:
        return s
    B, C, K, G, _ = s.shape

    def view(role, x):
        if role == "head":  # [N, ...] -> [1,1,K,G,1, ...]
            return x.reshape(1, 1, K, G, 1, *x.shape[1:])
        if role == "q":  # [B,T,N] -> the chunk's [B,C,K,G,1]
            x = jax.lax.dynamic_slice_in_dim(x, t0, C, axis=1)
            return x.reshape(B, C, K, G, 1)
        x = x.reshape(B, x.shape[1], K, G)  # [B,S,N] -> gathered [B,C,K,G,M]
        b = jnp.arange(B)[:, None, None, None, None]
        h = jnp.arange(K)[None, None, :, None, None]
        g = jnp.arange(G)[None, None, None, :, None]
        return x[b, index, h, g]

    views = {role: [view(role, x) for x in xs] for role, xs in structure.by_role(leaves).items()}
    return structure.apply(s, q_pos, k_pos, views)


def softmax_out(c: Call, s, ok, vg):
    """``(out [B,C,K,G,E], lse [B,C,K,G])`` from logits, visibility and gathered values
    ``vg [B,C,K,Gs,M,E]``: float32 statistics, zeros and ``-inf`` where nothing is visible."""
    s = jnp.where(ok, s, MASKED)
    m = s.max(-1, keepdims=True)
    sink = None if c.sink_logits is None else c.sink_logits[None, None, :, :, None]
    if sink is not None:
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(m)
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    den = p.sum(-1, keepdims=True)
    if sink is not None:
        den = den + jnp.exp(sink - m)
    safe = jnp.where(den > 0, den, 1.0)
    w, vg = p / safe, vg.astype(jnp.float32)
    if vg.shape[3] == 1:
        out = jnp.einsum("BCKGM,BCKME->BCKGE", w, vg[:, :, :, 0])
    else:
        out = jnp.einsum("BCKGM,BCKGME->BCKGE", w, vg)
    lse = jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)[..., 0]
    return out, lse


def gathered_attention(c: Call, q, k, v, start, stop, *, block: int, chunk: int = DEFAULT_CHUNK):
    """Attention of each query over the key ranges it selected (module docstring).

    Args:
      c: the checked call.
      q: ``[B,T,N,H]``; k: ``[B,S,K,H]``; v: ``[B,S,K,E]``.
      start, stop: ``[B,T,X,n]`` int32 (X = 1, K or N: who shares a selection): the
        selected key index ranges ``[start, stop)``, each at most ``block`` long and
        disjoint for one selection; ``stop <= start`` selects nothing.
      block: the longest range (1 for single tokens).
      chunk: queries per step.

    Returns:
      ``(out [B,T,N,E] in q's dtype, lse [B,T,N] float32)``.
    """
    B, T, _, N, K, G, _, E = c.dims
    q, k, v = c.isolate(q, k, v)
    # A gather's gradient sums the parts of every query that read a key, over the chunk and
    # then over the chunks: gathered from float32 copies, that sum is float32 and bf16 keys
    # and values are rounded once (summed in bf16, dk was 2e-2 off at 256 queries a chunk).
    # The matmuls still take the inputs' dtype.
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    start, stop = per_kv_head(start, K, G), per_kv_head(stop, K, G)
    C, n = chunks(T, chunk)
    xs = (
        split(q, C),
        split(start, C),
        split(stop, C),
        split(c.q_positions, C),
        None if c.q_segment_ids is None else split(c.q_segment_ids, C, PADDING),
        jnp.arange(n) * C,
    )
    call = _with_padded_q_leaves(c, n * C - T)

    @jax.checkpoint
    def one(xs):
        qc, lo, hi, pc, sc, t0 = xs
        index, real = block_tokens(lo, hi, block)
        s, ok = logits(call, qc, k, index, real, (pc, sc, t0))
        return softmax_out(call, s, ok, take(v, index))

    out, lse = jax.lax.map(one, xs)
    out, lse = unsplit(out, T).reshape(B, T, N, E), unsplit(lse, T).reshape(B, T, N)
    return out.astype(q.dtype), lse


def chunks(T: int, chunk: int) -> tuple[int, int]:
    """``(C, n)``: the chunk length and how many chunks cover T queries."""
    C = min(chunk, T)
    return C, -(-T // C)


def split(x, C: int, fill=0):
    """``x [B,T,...]`` padded with ``fill`` to whole chunks: ``[n,B,C,...]``."""
    B, T = x.shape[:2]
    pad = -T % C
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(B, (T + pad) // C, C, *x.shape[2:]), 1, 0)


def unsplit(x, T: int):
    """Inverse of ``split``: ``[n,B,C,...]`` -> ``[B,T,...]``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


def _with_padded_q_leaves(c: Call, pad: int) -> Call:
    """The call with its modifier's query leaves padded by ``pad`` queries (chunks read them
    by offset)."""
    structure, leaves = scores.split(c.score_mod)  # the soft-cap has no leaves
    if structure is None or pad == 0:
        return c
    groups = structure.by_role(leaves)
    groups["q"] = [jnp.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in groups["q"]]
    return dataclasses.replace(c, score_mod=structure.rebuild(structure.merge(groups)))


def jit_static(*names):
    """``jax.jit`` with ``names`` static: the sparse entry points' boundary."""
    return functools.partial(jax.jit, static_argnames=names)
