"""PaTH's decoding: a cache of keys carried through the transforms of the tokens after them.

A cached key j holds ``H_{t-1} ... H_{j+1} k_j`` once token t - 1 has arrived
(``path_update_keys`` applies each arriving token's transform to every slot,
``path_transform_keys`` gives the whole cache after a prefill), so plain
softmax attention over the cache is PaTH's; a chunk's queries carried back to
its start (``path_transform_queries``) read such a cache. The transforms and
their compact form are ``attn.softmax.path``'s.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from attn import checks
from attn.checks import as_arrays, fail
from attn.masks import drop_padding
from attn.softmax.path import blocks, check_beta, check_float, pass_block, unblock, ut

__all__ = ["path_transform_keys", "path_transform_queries", "path_update_keys"]


def path_update_keys(k_cache, w, beta, *, segment_ids=None):
    """Cached keys carried through the transforms of arriving tokens (PaTH's decoding).

    A cache of keys ``k_cache [B,S,K,H]`` whose key j holds ``H_{t-1} ... H_{j+1} k_j``
    (each key carried up to the last token that arrived, t - 1) becomes ``H_t
    ... H_{j+1} k_j`` for token t's ``w [B,K,H]``, ``beta [B,K]``: every slot is
    transformed (a slot is one key: what unused slots hold stays in them).
    Decoding token t: update the cache, store ``k_t`` as it is, and attend with
    plain softmax (``attn.attention`` or ``attn.decode_attention``, FoX as
    ``scores.Forgetting`` over the running gate sums): the logits are PaTH's.

    Several tokens at once (a chunk, in order): ``w [B,C,K,H]``, ``beta [B,C,K]``
    apply ``H_{t+C-1} ... H_t`` (the compact form: one C x C triangular solve).

    Args:
      k_cache: ``[B,S,K,H]``.
      w, beta: one token's ``[B,K,H]``, ``[B,K]`` or a chunk's ``[B,C,K,H]``, ``[B,C,K]``.
      segment_ids: None, or ``[B]`` (one token) / ``[B,C]`` ints: id 0 marks a
        padding token, whose transform is the identity (its w and beta may hold
        anything).

    Returns:
      The cache in its dtype (computed in float32).
    """
    k_cache, w, beta, segment_ids = as_arrays(k_cache, w, beta, segment_ids)
    if getattr(k_cache, "ndim", None) != 4 or not jnp.issubdtype(k_cache.dtype, jnp.floating):
        got = f"{getattr(k_cache, 'dtype', type(k_cache).__name__)} {np.shape(k_cache)}"
        fail("k_cache", "a floating-point array [B,S,K,H]", got)
    B, _, K, H = k_cache.shape
    one = getattr(w, "ndim", None) == 3
    lead = (B,) if one else (B, np.shape(w)[1] if getattr(w, "ndim", 0) == 4 else 0)
    layout = "[B,K,H] (one token) or [B,C,K,H] (a chunk)"
    if getattr(w, "ndim", None) not in (3, 4):
        fail("w", layout, f"shape {np.shape(w)}")
    check_float(w, "w", (*lead, K, H), layout)
    check_float(beta, "beta", (*lead, K), "[B,K] or [B,C,K] like w")
    ids = None
    if segment_ids is not None:
        ids = checks.segment_ids(segment_ids, "segment_ids", B, None if one else lead[1])
    check_beta(beta, ids)
    if one:  # one token as a chunk of one
        w, beta, ids = w[:, None], beta[:, None], None if ids is None else ids[:, None]
    w32 = drop_padding(w, ids).astype(jnp.float32)
    b32 = drop_padding(beta, ids).astype(jnp.float32)
    w32, b32 = jnp.moveaxis(w32, 1, 2), jnp.moveaxis(b32, 1, 2)  # [B,K,C,H], [B,K,C]
    x, _ = ut(w32, b32)
    keys = k_cache.astype(jnp.float32)  # [B,S,K,H]; (I - W^T X) k = k - sum_s (x_s . k) w_s
    keys = keys - jnp.einsum("bksc,bkch->bskh", jnp.einsum("bskh,bkch->bksc", keys, x), w32)
    return keys.astype(k_cache.dtype)


def path_transform_keys(k, w, beta, *, block_size: int = 64, segment_ids=None):
    """Each key carried through the transforms of every later token: ``H_{T-1} ...
    H_{j+1} k_j`` ``[B,T,K,H]``, what a PaTH cache holds after a prefill of T tokens
    (``path_update_keys`` then continues it).

    Blocks of ``block_size`` in the compact form of ``path_attention``'s blockwise
    form: a key leaves its block in one solve, then a scan from the last block
    to the first carries the product of the blocks after it (``[H,H]`` per head).

    Args:
      k, w: ``[B,T,K,H]``; beta: ``[B,T,K]`` in [0, 2].
      block_size: the blocks' length.
      segment_ids: None or ``[B,T]`` ints: id 0 marks padding, whose transform is the
        identity and whose key is 0 (w, beta and k there may hold anything).

    Returns:
      ``[B,T,K,H]`` in k's dtype.
    """
    k, w, beta, segment_ids = as_arrays(k, w, beta, segment_ids)
    if getattr(k, "ndim", None) != 4 or not jnp.issubdtype(k.dtype, jnp.floating):
        got = f"{getattr(k, 'dtype', type(k).__name__)} {np.shape(k)}"
        fail("k", "a floating-point array [B,T,K,H]", got)
    B, T, K, H = k.shape
    check_float(w, "w", k.shape, "[B,T,K,H] like k")
    check_float(beta, "beta", (B, T, K), "[B,T,K]")
    C = checks.positive_int(block_size, "block_size")
    ids = checks.segment_ids(segment_ids, "segment_ids", B, T)
    check_beta(beta, ids)
    k32, w32, b32 = (drop_padding(x, ids).astype(jnp.float32) for x in (k, w, beta))
    n = -(-T // C)
    kb, wb = (blocks(x, n, C, 1) for x in (k32, w32))  # [n,B,K,C,H]
    xb, d = ut(wb, blocks(b32, n, C, 1), kb)
    k_end = kb - jnp.einsum("nbktj,nbkth->nbkjh", d, wb)

    def block(m, x):  # m [B,K,H,H]: the product of the blocks after this one
        k_j, w_j, x_j = x
        out = jnp.einsum("bkjh,bkgh->bkjg", k_j, m)
        return pass_block(m, w_j, x_j), out  # rows of m: m P_j

    eye = jnp.broadcast_to(jnp.eye(H, dtype=jnp.float32), (B, K, H, H))
    out = lax.scan(block, eye, (k_end, wb, xb), reverse=True)[1]  # [n,B,K,C,H]
    return unblock(out, 3)[:, :T].astype(k.dtype)


def path_transform_queries(q, w, beta, *, segment_ids=None):
    """Each query of a chunk carried back to the chunk's start: ``(H_i ... H_0)^T q_i``.

    Query i of a chunk of tokens ``0 .. C-1`` (in order, following a cache whose
    keys are carried up to the token before the chunk, ``path_update_keys``)
    reaches a cached key through its chunk's transforms up to its own,
    ``q_i^T H_i ... H_0 k~_j``: the returned ``q'_i = H_0 ... H_i q_i`` (each
    ``H`` is symmetric) against the cached keys gives PaTH's logits. The compact
    form: ``H_i ... H_0 = I - sum_{s<=i} w_s x_s^T`` (one C x C triangular solve).

    Args:
      q: queries ``[B,C,N,H]``, N a multiple of K.
      w, beta: the chunk's ``[B,C,K,H]``, ``[B,C,K]`` (beta in [0, 2]).
      segment_ids: None, or ``[B,C]`` ints: id 0 marks a padding token, whose
        transform is the identity (its w and beta may hold anything).

    Returns:
      ``[B,C,N,H]`` in q's dtype (computed in float32).
    """
    q, w, beta, segment_ids = as_arrays(q, w, beta, segment_ids)
    if getattr(q, "ndim", None) != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        got = f"{getattr(q, 'dtype', type(q).__name__)} {np.shape(q)}"
        fail("q", "a floating-point array [B,C,N,H]", got)
    B, C, N, H = q.shape
    K = np.shape(w)[2] if getattr(w, "ndim", None) == 4 else 0
    if not K or N % K:
        fail("w", f"shape [B,C,K,H] = ({B}, {C}, K, {H}) with K dividing N={N}", np.shape(w))
    check_float(w, "w", (B, C, K, H), "[B,C,K,H]")
    check_float(beta, "beta", (B, C, K), "[B,C,K]")
    ids = checks.segment_ids(segment_ids, "segment_ids", B, C)
    check_beta(beta, ids)
    w32, b32 = (jnp.moveaxis(drop_padding(x, ids).astype(jnp.float32), 1, 2) for x in (w, beta))
    x, _ = ut(w32, b32)  # [B,K,C,H]
    q32 = q.astype(jnp.float32).reshape(B, C, K, N // K, H)
    incl = np.tril(np.ones((C, C), bool))
    qw = jnp.where(incl, jnp.einsum("bikgh,bkth->bkgit", q32, w32), 0)  # q_i . w_t, t <= i
    out = q32 - jnp.einsum("bkgit,bkth->bikgh", qw, x)
    return out.reshape(B, C, N, H).astype(q.dtype)
