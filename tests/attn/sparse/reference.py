"""Naive sparse attention from the papers' equations: which keys each query reads, as a mask.

Each reference loops over queries in NumPy float64 and writes down, from its
paper, the set of keys a query reads (MoBA: its blocks by gate; NSA: the
compressed blocks, the selected blocks, the window; DSA: its top-k tokens by
the lightning indexer). The attention itself is then dense softmax attention
restricted to that set (``attend``), run in float64 for the gradients. Blocks
are found by position within each segment, from the keys' own ids and
positions, not through the fast forms' layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn import dot_product_attention
from attn.masks import Mask


def visibility(mask: Mask, q_pos, kv_pos, q_seg, kv_seg):
    """``[B,T,S]`` bool: the mask on positions, within segments, padding seeing nothing."""
    ok = np.asarray(mask.allowed(np.asarray(q_pos), np.asarray(kv_pos)))
    q_seg, kv_seg = np.asarray(q_seg), np.asarray(kv_seg)
    return ok & (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)


def groups(kv_pos, kv_seg, size: int, b: int, seg: int):
    """The blocks of ``size`` positions of segment ``seg`` in row ``b``: ``{j: [key index]}``."""
    out = {}
    for s in np.flatnonzero(np.asarray(kv_seg)[b] == seg):
        out.setdefault(int(kv_pos[b, s]) // size, []).append(int(s))
    return out


def moba_reads(q, k, vis, q_pos, q_seg, kv_pos, kv_seg, *, block_size, top_k, gaps=None):
    """``[B,N,T,S]`` bool: the keys MoBA's gate gives each query head (Lu et al. 2025).

    A block scores ``q . mean(k over the block)`` (float64, as MoBA's paper and its
    ``moba_attn_varlen_naive`` score in the inputs' precision); the query's own block, then
    the blocks it sees in part, are kept first; blocks it sees whole compete; ``top_k``
    blocks in all. ``gaps``, where given, receives each row's gate gap at the cut (the last
    block read against the best one left out) where a block was left out.
    """
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T, N, _ = q.shape
    G = N // k.shape[2]
    reads = np.zeros((B, N, T, k.shape[1]), bool)
    for b in range(B):
        for t in range(T):
            blocks = groups(kv_pos, kv_seg, block_size, b, int(q_seg[b, t]))
            for n in range(N):
                scored = []
                for j, keys in blocks.items():
                    seen = vis[b, t, keys]
                    if not seen.any():
                        continue
                    own = j == int(q_pos[b, t]) // block_size
                    gate = q[b, t, n] @ k[b, keys, n // G].mean(0)
                    rank = 2 if own else 1 if not seen.all() else 0
                    scored.append((rank, gate, keys))
                scored.sort(key=lambda x: (-x[0], -x[1]))  # stable: ties keep block order
                if gaps is not None and len(scored) > top_k and scored[top_k - 1][0] == 0:
                    gaps.append(scored[top_k - 1][1] - scored[top_k][1])
                for *_, keys in scored[:top_k]:
                    reads[b, n, t, keys] = True
    return reads & vis[:, None]


def dsa_scores(index_q, index_k, index_w):
    """The lightning indexer (DeepSeek-V3.2): ``I[t,s] = sum_i w[t,i] relu(q[t,i] . k[s])``."""
    iq, ik, iw = (np.asarray(x, np.float64) for x in (index_q, index_k, index_w))
    return np.einsum("bti,btis->bts", iw, np.maximum(np.einsum("btif,bsf->btis", iq, ik), 0))


def int8(x):
    """``x [..., F]`` rounded to integers times the power of two that puts its largest
    magnitude in [64, 128): ``(integers, scale [...])`` (DSA's 8-bit indexer scores)."""
    x = np.asarray(x, np.float64)
    scale = 2.0 ** (np.frexp(np.abs(x).max(-1, keepdims=True))[1] - 7)
    return np.round(x / scale), scale[..., 0]


def dsa_selection_scores(index_q, index_k, index_w):
    """``dsa_scores`` on 8-bit operands (``int8``): each indexer query (per token and head)
    and key rounded."""
    (qi, qs), (ki, ks) = int8(index_q), int8(index_k)
    w = np.asarray(index_w, np.float64) * qs
    return dsa_scores(qi, ki, w) * ks[:, None, :]


def dsa_reads(scores, vis, top_k):
    """``[B,T,S]`` bool: each query's ``top_k`` visible tokens by the indexer."""
    reads = np.zeros(vis.shape, bool)
    for b, t in np.ndindex(*vis.shape[:2]):
        seen = np.flatnonzero(vis[b, t])
        reads[b, t, seen[np.argsort(-scores[b, t, seen], kind="stable")[:top_k]]] = True
    return reads


def nsa_blocks(kv_pos, kv_seg, block, stride):
    """Every compressed block of each row: ``[(b, seg, first position, [key index])]``."""
    out = []
    for b in range(kv_pos.shape[0]):
        for seg in sorted(set(np.asarray(kv_seg)[b].tolist()) - {0}):
            keys = {int(kv_pos[b, s]): int(s) for s in np.flatnonzero(kv_seg[b] == seg)}
            for p in sorted(keys):
                span = range(p, p + block)
                if p % stride == 0 and all(x in keys for x in span):
                    out.append((b, seg, p, [keys[x] for x in span]))
    return out


def nsa_reads(q, vis, q_pos, q_seg, kv_pos, kv_seg, cmp_keys, cmp_blocks, sizes):
    """NSA's (Yuan et al. 2025) three sets of what each query reads.

    Returns ``(cmp [B,T,M] bool over the compressed blocks, slc [B,K,T,S], win [B,T,S])``:
    a compressed block is read when every key in it is visible; the selected blocks score the
    compressed probabilities (summed over the kv head's group) of the compressed blocks that
    overlap them; the window is the last ``window`` positions.
    """
    q = np.asarray(q, np.float64)
    B, T, N, H = q.shape
    K = cmp_keys.shape[2]
    G, M = N // K, len(cmp_blocks)
    l, sel = sizes["compress_block"], sizes["select_block"]
    cmp = np.zeros((B, T, M), bool)
    slc = np.zeros((B, K, T, vis.shape[2]), bool)
    for b, t in np.ndindex(B, T):
        for m, (bb, seg, _, keys) in enumerate(cmp_blocks):
            cmp[b, t, m] = bb == b and seg == q_seg[b, t] and vis[b, t, keys].all()
        blocks = groups(kv_pos, kv_seg, sel, b, int(q_seg[b, t]))
        first_block = min(blocks, default=0)
        own = int(q_pos[b, t]) // sel
        for h in range(K):
            p = np.zeros(M)  # the compressed probabilities, summed over the group's heads
            if cmp[b, t].any():
                s = np.einsum("gh,mh->gm", q[b, t, h * G : (h + 1) * G], cmp_keys[b, :, h])
                e = np.where(cmp[b, t], np.exp(s * H**-0.5 - (s * H**-0.5).max()), 0.0)
                p = (e / e.sum(-1, keepdims=True)).sum(0)
            scored = []
            for j, keys in blocks.items():
                if not vis[b, t, keys].any():
                    continue
                score = sum(
                    p[m]
                    for m, (_, _, first, _) in enumerate(cmp_blocks)
                    if cmp[b, t, m] and first // sel <= j <= (first + l - 1) // sel
                )
                forced = (
                    j - first_block < sizes["initial_blocks"]
                    or own - sizes["local_blocks"] < j <= own
                )
                scored.append((np.inf if forced else score, keys))
            scored.sort(key=lambda x: -x[0])
            for _, keys in scored[: sizes["num_selected"]]:
                slc[b, h, t, keys] = True
    slc &= vis[:, None]
    win = vis & (np.asarray(kv_pos)[:, None, :] > np.asarray(q_pos)[:, :, None] - sizes["window"])
    return cmp, slc, win


def attend(q, k, v, reads, **call_args):
    """Dense attention restricted to ``reads`` (``[B,T,S]`` or ``[B,N,T,S]`` bool) in the
    arrays' dtype (float64 under ``jax.enable_x64``)."""
    reads = jnp.asarray(reads)
    reads = reads[:, None] if reads.ndim == 3 else reads
    return dot_product_attention(q, k, v, mask=reads, **call_args)


def float64_grads(fn, args, cotangent):
    """``fn(*args)`` and the gradient of ``sum(fn(*args) * cotangent)`` in float64."""
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in args]
        ct = jnp.asarray(cotangent, jnp.float64)
        out, vjp = jax.vjp(fn, *args)
        return np.asarray(out), [np.asarray(g) for g in vjp(ct)]


def packed_rows(T: int = 40, B: int = 2):
    """Row 0 packs three sequences and ends in padding, row 1 is one sequence: segment ids and
    the positions that restart per sequence (``[B,T]`` each)."""
    lengths = [(1, 13), (2, 17), (3, 6), (0, T - 36)]
    seg = np.ones((B, T), np.int32)
    pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    i = 0
    for sid, n in lengths:
        seg[0, i : i + n], pos[0, i : i + n] = sid, np.arange(n)
        i += n
    return seg, pos


def with_nan_padding(x, seg):
    """``x [B,L,...]`` with NaN in every padding token (what a recycled cache slot may hold)."""
    x = np.array(x)
    x[np.asarray(seg) == 0] = np.nan
    return x
