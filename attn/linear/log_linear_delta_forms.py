"""The two forms of log-linear Gated DeltaNet: a scan over tokens and chunks in the WY form.

Internal to ``attn.linear.log_linear``, which validates, scales q, applies the
segment rules and casts. Both forms take float32 inputs laid out for grouped
value heads and compute the same function:

    q, k    ``[B,T,K,H]``        K query/key heads (q already scaled)
    v       ``[B,T,K,G,E]``      G value heads per query/key head (N = K G)
    beta    ``[B,T,K,G]``        0 at padding: no write
    log_g   ``[B,T,K,G]``        0 at padding, ``-inf`` where a segment starts
    lam     ``[B,T,K,G,L]``      the level weights
    pos     ``[B,T]`` int32      each token's position in its segment

and return ``out [B,T,K,G,E]`` (and, on request, the Fenwick states
``[B,K,G,L,H,E]`` after the last real token).

The function: with the Gated DeltaNet transition ``A_r = a_r (I - beta_r k_r k_r^T)``
and ``Phi(s -> t) = A_t ... A_{s+1}``,

    o_t = sum_{s <= t} lambda_t^(level(t, s)) (q_t^T Phi(s -> t) k_s) beta_s v_s

so each level's state is the delta-rule state of its bucket run alone, carried
to t by the transitions (writes go to level 0 only). All weights 1 is Gated
DeltaNet.

Axis letters besides the vocabulary: ``U`` the chunk index, ``C``/``J`` (and
``R``, ``S``) token positions inside a chunk, ``W`` the chunk levels.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from attn.linear.delta_forms import unit_lower_inverse
from attn.linear.forms import scan_in_pieces, segsum
from attn.linear.log_linear_forms import (
    bit_length,
    chunk_dims,
    chunks,
    fenwick_levels,
    merge,
    np_levels,
    one_hot,
    rows,
    write_and_read,
)

# ----------------------------------------------------------------------------
# Recurrent


def step(levels, q_t, k_t, v_t, beta_t, log_g_t, lam_t, pos_t, real_t=None):
    """One token: merge, the transition ``a (I - beta k k^T)`` on every level, the write
    ``beta k v^T`` at level 0, the weighted read.

    levels ``[B,K,G,L,H,E]``; q_t, k_t ``[B,K,H]``; v_t ``[B,K,G,E]``; beta_t,
    log_g_t ``[B,K,G]``; lam_t ``[B,K,G,L]``; pos_t ``[B]``; real_t ``[B]`` or None.

    Returns ``(levels, out_t [B,K,G,E])``.
    """
    new = merge(levels, pos_t)
    predicted = jnp.einsum("BKH,BKGLHE->BKGLE", k_t, new)  # S^T k per level
    erase = jnp.einsum("BKH,BKGLE->BKGLHE", k_t, beta_t[..., None, None] * predicted)
    new = (new - erase) * jnp.exp(log_g_t)[..., None, None, None]
    return write_and_read(levels, new, k_t, beta_t[..., None] * v_t, q_t, lam_t, real_t)


def recurrent(q, k, v, beta, log_g, lam, pos, key_real, init=None):
    """A scan over tokens (``scan_in_pieces``) from the levels ``init [B,K,G,L,H,E]`` (or
    None: zeros); returns ``(out, levels)``."""
    B, T, K, H = q.shape
    G, E = v.shape[3:]
    L = lam.shape[-1]
    if key_real is None:
        key_real = jnp.ones((B, T), bool)

    def one_step(levels, x):
        return step(levels, *x)

    if init is None:
        init = jnp.zeros((B, K, G, L, H, E), jnp.float32)
    xs = (q, k, v, beta, log_g, lam, pos, key_real)
    final, out = scan_in_pieces(one_step, init, xs, T)
    return out, final


# ----------------------------------------------------------------------------
# Chunkwise


def chunkwise(q, k, v, beta, log_g, lam, chunk_size: int, last=None):
    """Chunks of C = 2^c tokens in the WY form; a scan over chunks carries the chunk levels.

    Inside a chunk (all chunks at once): with ``T^-1 = (I + tril(diag(beta)
    (K K^T * decay), -1))^-1`` (``unit_lower_inverse``), the effective attention
    ``A = tril(Q K^T * decay) T^-1 diag(beta)`` has ``A[t, s] = q_t^T Phi(s -> t)
    beta_s k_s``, so the levels up to c are ``(A * Lambda) V`` with the constant
    level table. From the WY form too: the query as it reads a state entering
    the chunk, ``Q~ = start * Q - A (K * start)``; the chunk's transition
    ``S -> decay S - (K * end)^T (W S)`` with ``W = T^-1 diag(beta) (K * start)``;
    and the chunk's own state from zero, ``(K * end)^T T^-1 diag(beta) V``.

    Across chunks the Fenwick tree is over chunk indices: a scan carries one
    state per chunk level j (token level ``c + j``), each the delta-rule state
    of its bucket of chunks carried to the current chunk's start; before chunk
    u the previous chunk's own state and the levels below the lowest set bit
    of u merge into that bit's level, the chunk's queries read every level
    through ``Q~``, and every level takes the chunk's transition.

    Positions are ``0 .. M-1`` (the caller aligns segments). ``last [B]`` (or
    None): the token whose Fenwick states ``[B,K,G,L,H,E]`` to return too.

    Cost: ``O(T C (C + H + E))`` inside chunks (the inverse is C^2 per token),
    and per chunk level, ``log2(T/C)`` of them, ``3 T H E`` in the scan (a read
    and a transition of two matmuls). Measured on CPU (T = 4096, C = H = E = 64):
    1.8 times Gated DeltaNet's chunkwise forward, 2.7 times forward and backward.
    """
    B, M, K, G, E, L, C, c, U = chunk_dims(q, v, lam, chunk_size)
    W = (U - 1).bit_length()  # chunk levels (the W axis)
    qc = jnp.moveaxis(chunks(q, U, C), 2, 3)  # [U,B,K,C,H]
    kc = jnp.moveaxis(chunks(k, U, C), 2, 3)  # [U,B,K,J,H]
    vc = jnp.moveaxis(chunks(v, U, C), 2, 4)  # [U,B,K,G,J,E]
    bc = jnp.moveaxis(chunks(beta, U, C), 2, -1)  # [U,B,K,G,J], 0 past M
    gc = jnp.moveaxis(chunks(log_g, U, C), 2, -1)  # [U,B,K,G,C]
    lamc = jnp.moveaxis(chunks(lam, U, C), 2, -2)  # [U,B,K,G,C,L]

    decay = jnp.exp(segsum(gc))  # [U,B,K,G,C,J], 0 above the diagonal
    start = jnp.exp(jnp.cumsum(gc, axis=-1))  # [U,B,K,G,C]: from the chunk's start
    end = decay[..., -1, :]  # [U,B,K,G,J]: to the chunk's end
    index = np.arange(C)
    strict = jnp.asarray(index[:, None] > index[None, :])
    kk = jnp.einsum("UBKCH,UBKJH->UBKCJ", kc, kc)[:, :, :, None] * decay
    inverse = unit_lower_inverse(jnp.where(strict, bc[..., :, None] * kk, 0.0))
    inverse = inverse * bc[..., None, :]  # T^-1 diag(beta)
    qk = jnp.einsum("UBKCH,UBKJH->UBKCJ", qc, kc)[:, :, :, None] * decay
    attend = qk @ inverse  # [U,B,K,G,C,J]: q_t^T Phi(s -> t) beta_s k_s
    k_start = kc[:, :, :, None] * start[..., None]  # [U,B,K,G,J,H]
    w = inverse @ k_start
    q_read = qc[:, :, :, None] * start[..., None] - attend @ k_start  # [U,B,K,G,C,H]
    k_end = kc[:, :, :, None] * end[..., None]  # [U,B,K,G,J,H]
    own = jnp.einsum("UBKGJH,UBKGJE->UBKGHE", k_end, inverse @ vc)

    table = np_levels(index[:, None], index[None, :], L)
    table_hot = (table[..., None] == np.arange(L)) & (index[:, None] >= index[None, :])[..., None]
    lam_cj = jnp.einsum("UBKGCL,CJL->UBKGCJ", lamc, jnp.asarray(table_hot, jnp.float32))
    out = (attend * lam_cj) @ vc  # [U,B,K,G,C,E]

    if W:
        slots = np.minimum(c + np.arange(1, W + 1), L - 1)
        u_last = None if last is None else last // C
        xs = (q_read, w, k_end, start[..., -1], own, lamc[..., slots])
        read, at_last = _across_chunks(*xs, u_last)
        out = out + read
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, U * C, K, G, E)[:, :M]
    if last is None:
        return out, None

    # The Fenwick states seen from `last`: the chunk levels carried through its chunk,
    # and the keys of its chunk split by the level of their offset from it.
    u_last, i_last = last // C, last % C

    def at(x):  # [U,B,...] -> [B,...] at each row's chunk of `last`
        return rows(jnp.moveaxis(x, 0, 1), u_last)

    row = rows(jnp.moveaxis(at(decay), 3, 1), i_last)  # [B,K,G,J]: Gamma[last, s], 0 past it
    k_row = at(kc)[:, :, None] * row[..., None]  # [B,K,G,J,H]
    keys = jnp.einsum("BKGRH,BKGRS->BKGSH", k_row, at(inverse))  # Phi(s -> last) beta_s k_s
    split = one_hot(fenwick_levels(i_last[:, None], jnp.arange(C)[None, :], L), L)  # [B,S,L]
    states = jnp.einsum("BKGSH,BSL,BKGSE->BKGLHE", keys, split, at(vc))
    if W:
        start_last = rows(jnp.moveaxis(at(start), 3, 1), i_last)  # [B,K,G]
        wy = jnp.einsum("BKGJH,BKGWHE->BKGWJE", at(w), at_last)
        carried = start_last[..., None, None, None] * at_last - jnp.einsum(
            "BKGJH,BKGWJE->BKGWHE", k_row, wy
        )
        to_level = jnp.asarray(slots[:, None] == np.arange(L), jnp.float32)  # [W,L]
        states = states + jnp.einsum("BKGWHE,WL->BKGLHE", carried, to_level)
    return out, states


def _across_chunks(q_read, w, k_end, chunk_decay, own, lam_levels, u_last=None):
    """The scan over chunks of ``chunkwise``: the chunk levels' reads ``[U,B,K,G,C,E]`` and,
    with ``u_last [B]``, the chunk levels ``[B,K,G,W,H,E]`` after the merge at each row's
    chunk ``u_last`` (else None).

    Inputs per chunk: q_read ``[U,B,K,G,C,H]`` (``Q~``), w and k_end ``[U,B,K,G,J,H]``,
    chunk_decay ``[U,B,K,G]``, own ``[U,B,K,G,H,E]`` (the chunk's state from zero),
    lam_levels ``[U,B,K,G,C,W]`` (the weights of the W chunk levels). Every product is
    one matmul batched over ``Z = B K G``, the W level states side by side as the
    columns ``[H, W E]`` of one matrix.
    """
    U, B, K, G, C, H = q_read.shape
    E, W = own.shape[-1], lam_levels.shape[-1]
    Z = B * K * G

    def flat(x):  # [U,B,K,G,...] -> [U,Z,...]
        return x.reshape(U, Z, *x.shape[4:])

    level = jnp.arange(1, W + 1)[:, None]  # the W axis of [Z,H,W,E]
    here = None if u_last is None else jnp.repeat(u_last, K * G)  # [Z]

    def advance(carry, x):
        states, previous, at_last = carry  # [Z,H,W,E], [Z,H,E], [Z,H,W,E]
        u, q_u, w_u, k_end_u, decay_u, own_u, lam_u = x
        target = jnp.minimum(bit_length(u & -u), W)  # 0 at u = 0: nothing merges
        merged = previous + jnp.sum(jnp.where(level <= target, states, 0.0), axis=2)
        states = jnp.where(
            level < target, 0.0, jnp.where(level == target, merged[:, :, None], states)
        )
        if here is not None:
            at_last = jnp.where((u == here)[:, None, None, None], states, at_last)
        columns = states.reshape(Z, H, W * E)
        read = jnp.einsum("ZCH,ZHX->ZCX", q_u, columns).reshape(Z, C, W, E)
        read = jnp.einsum("ZCWE,ZCW->ZCE", read, lam_u)
        wy = jnp.einsum("ZJH,ZHX->ZJX", w_u, columns)
        columns = decay_u[:, None, None] * columns - jnp.einsum("ZJH,ZJX->ZHX", k_end_u, wy)
        return (columns.reshape(Z, H, W, E), own_u, at_last), read

    zeros = jnp.zeros((Z, H, W, E), jnp.float32)
    init = (zeros, jnp.zeros((Z, H, E), jnp.float32), zeros)
    xs = (jnp.arange(U), *(flat(x) for x in (q_read, w, k_end, chunk_decay, own, lam_levels)))
    (_, _, at_last), read = lax.scan(advance, init, xs)
    read = read.reshape(U, B, K, G, C, E)
    if u_last is None:
        return read, None
    return read, jnp.moveaxis(at_last.reshape(B, K, G, H, W, E), 4, 3)
