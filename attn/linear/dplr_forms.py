"""The two forms of the DPLR delta rule: a scan over tokens, and chunks in a WY form.

Internal to ``attn.linear.dplr``, which validates, scales q, applies the
segment rules and casts. Both forms take float32 inputs laid out for grouped
value heads and compute the same function:

    q, k    ``[B,T,K,H]``       K query/key heads
    a, b    ``[B,T,K,G,H]``     the rank-one part of the transition, per value head
    v       ``[B,T,K,G,E]``     G value heads per query/key head (N = K G)
    log_w   ``[B,T,K,G,H]``     log decays per key channel: 0 at padding and time
            padding, ``-inf`` zeroes a channel's diagonal (a segment start on all)
    state   ``[B,K,G,H,E]`` or None (zeros)

and return ``out [B,T,K,G,E]`` and the final state ``[B,K,G,H,E]``. A token
whose inputs are all zero (and ``log_w`` 0) leaves the state as it was.

Axis letters besides the vocabulary: ``U`` the chunk index, ``C``/``J`` query
and key positions inside a chunk, ``X`` a flattened batch of matmuls (the
chunks of every value head), ``L``/``R`` the left and right operands of the
decayed products, ``I`` a second key channel.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from attn.linear.delta_forms import unit_lower_inverse
from attn.linear.forms import exclusive_suffix, scan_tokens


def step(state, q_t, k_t, v_t, a_t, b_t, log_w_t):
    """One token: ``S <- diag(w) S + b (a^T S) + k v^T``, then the read ``S^T q``.

    q_t, k_t ``[B,K,H]``; v_t ``[B,K,G,E]``; a_t, b_t, log_w_t ``[B,K,G,H]``.
    Returns ``(state [B,K,G,H,E], out_t [B,K,G,E])``.
    """
    read = jnp.einsum("BKGH,BKGHE->BKGE", a_t, state)  # a^T S, before the decay
    state = jnp.exp(log_w_t)[..., None] * state + jnp.einsum("BKGH,BKGE->BKGHE", b_t, read)
    state = state + jnp.einsum("BKH,BKGE->BKGHE", k_t, v_t)
    return state, jnp.einsum("BKH,BKGHE->BKGE", q_t, state)


def recurrent(q, k, v, a, b, log_w, state):
    """A ``lax.scan`` over tokens, O(sqrt(T)) states kept for the backward pass."""
    B, _, K, H = q.shape
    shape = (B, K, v.shape[3], H, v.shape[4])  # [B,K,G,H,E]
    return scan_tokens(step, (q, k, v, a, b, log_w), state, shape)


# ----------------------------------------------------------------------------
# Chunkwise


def _chunks(x, U: int, C: int):
    """``[B,T,K,...] -> [U,B,K,C,...]`` chunk-major, zero-padding T to U C."""
    x = jnp.pad(x, [(0, 0), (0, U * C - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], U, C, *x.shape[2:]), (1, 2), (0, 3))


def _shift_down(x, axis: int):
    """``out[i] = x[i - 1]`` along ``axis``, ``out[0] = 0``."""
    pad = [(0, 0)] * x.ndim
    pad[axis % x.ndim] = (1, 0)
    return jnp.pad(lax.slice_in_dim(x, 0, x.shape[axis] - 1, axis=axis), pad)


def decayed_products(x, y, log_w):
    """``[X,L,R,C,C]``: ``sum_h x_ih y_jh exp(sum_{l=j+1..i} log_w_lh)`` for ``j <= i``, 0 above.

    ``x [X,L,C,H]`` (L left operands), ``y [X,R,C,H]`` (R right operands),
    ``log_w [X,C,H]``, all of one chunk. The decay differs per channel, so the
    product is no single matmul, and ``e^{gamma_i} e^{-gamma_j}`` (the running
    sums gamma) overflows once a chunk's decay passes ``e^-88``. Instead the
    chunk (zero-padded to a power of two) is halved recursively (the secondary
    split of fla's kernels, taken all the way down, as ``attn.linear.delta_forms``
    does for KDA): the two diagonal halves are products of the same kind
    (computed together), and the block of queries i in the second half against
    keys j in the first is one matmul of ``x_i exp(sum_{l=h..i} log_w_l)`` and
    ``y_j exp(sum_{l=j+1..h-1} log_w_l)``, split at the second half's first
    token h. Every ``exp`` is of a range sum of log decays <= 0, accumulated over
    its own range: every factor is at most 1, so nothing overflows whatever the
    decays, and ``-inf`` gives 0, never NaN. Memory: ``(L + R) H`` floats per
    token and level, log2(C) levels, besides the products; never a ``[C, C, H]``
    array.
    """
    C = x.shape[2]
    size = 1 << (C - 1).bit_length()  # a power of two: the halves always match
    if size > C:
        x, y = (jnp.pad(z, ((0, 0), (0, 0), (0, size - C), (0, 0))) for z in (x, y))
        log_w = jnp.pad(log_w, ((0, 0), (0, size - C), (0, 0)))
    return _halves(x, y, log_w)[..., :C, :C]


def _halves(x, y, log_w):
    """``decayed_products`` for C a power of two: one call per level, the two halves
    stacked along X (unequal halves would trace every sub-block apart)."""
    X, L, C = x.shape[:3]
    R = y.shape[1]
    if C == 1:
        return jnp.einsum("XLH,XRH->XLR", x[:, :, 0], y[:, :, 0])[..., None, None]
    h = C // 2
    first = (x[:, :, :h], y[:, :, :h], log_w[:, :h])
    second = (x[:, :, h:], y[:, :, h:], log_w[:, h:])
    both = _halves(*(jnp.concatenate(pair) for pair in zip(first, second, strict=True)))
    top, bottom = both[:X], both[X:]
    left = second[0] * jnp.exp(jnp.cumsum(second[2], axis=1))[:, None]  # h..i
    right = first[1] * jnp.exp(exclusive_suffix(first[2], 1))[:, None]  # j+1..h-1
    below = jnp.einsum("XLCH,XRJH->XLRCJ", left, right)
    upper = jnp.concatenate([top, jnp.zeros((X, L, R, h, h), top.dtype)], -1)
    return jnp.concatenate([upper, jnp.concatenate([below, bottom], -1)], -2)


def chunkwise(q, k, v, a, b, log_w, state, chunk_size: int):
    """Chunks of C tokens: the WY form inside, a scan of affine maps across.

    Inside a chunk with entering state ``S_0``, the reads ``r_t = a_t^T S_{t-1}``
    (rows ``[C, E]``) satisfy ``r = A_ab r + A_ak V + (A * before) S_0`` with the
    strictly lower ``A_ab[t, j] = a_t . (decay j+1..t-1) b_j`` (``A_ak`` with
    k_j): so ``r = R' + W S_0`` with ``R' = (I - A_ab)^{-1} A_ak V`` and
    ``W = (I - A_ab)^{-1} (A * before)``, one unit-lower-triangular inverse per
    chunk, all chunks at once. Then

        S_C = M S_0 + S',  M = diag(decay across) + (B * end)^T W,
                           S' = (B * end)^T R' + (K * end)^T V,
        O   = (Q * start) S_0 + A_qb r + A_qk V   (A_qb, A_qk: decays j+1..t, j <= t),

    where ``start``, ``before`` and ``end`` decay from the chunk's start through
    t, through t - 1, and from t + 1 to its end. The scan over chunks is the
    one matmul ``S <- M S + S'``; it keeps the state entering each chunk (T / C
    states) and the outputs are read afterwards from those, all chunks at once.
    Every decay is ``exp`` of a range sum of log decays (<= 0); the products
    are ``decayed_products``.
    """
    B, T, K, H = q.shape
    G, E = v.shape[3:]
    C = min(chunk_size, T)
    U = -(-T // C)
    X = U * B * K * G

    def per_value_head(x):  # [B,T,K,H] -> [X,C,H]
        x = _chunks(x, U, C)  # [U,B,K,C,H]
        return jnp.broadcast_to(x[:, :, :, None], (*x.shape[:3], G, *x.shape[3:])).reshape(X, C, H)

    def grouped(x):  # [B,T,K,G,...] -> [X,C,...]
        return jnp.moveaxis(_chunks(x, U, C), 3, 4).reshape(X, C, x.shape[-1])

    qc, kc = per_value_head(q), per_value_head(k)
    ac, bc, vc, gc = (grouped(x) for x in (a, b, v, log_w))
    reach = jnp.cumsum(gc, axis=1)  # chunk start through t
    start = jnp.exp(reach)
    before = jnp.exp(_shift_down(reach, 1))  # chunk start through t - 1
    end = jnp.exp(exclusive_suffix(gc, 1))  # t + 1 to the chunk's end
    across = jnp.exp(jnp.sum(gc, axis=1))  # [X,H]

    # Row t of the left operand a_next is a_{t+1}: its products with keys j <= t carry
    # the decay j+1..t, which shifted down one row is A_ab's j+1..(t+1)-1.
    a_next = jnp.pad(ac[:, 1:], ((0, 0), (0, 1), (0, 0)))
    products = decayed_products(jnp.stack([a_next, qc], 1), jnp.stack([bc, kc], 1), gc)
    A_ab, A_ak = (_shift_down(products[:, 0, i], 1) for i in (0, 1))
    A_qb, A_qk = products[:, 1, 0], products[:, 1, 1]
    inverse = unit_lower_inverse(-A_ab)  # (I - A_ab)^{-1}
    w = jnp.einsum("XCJ,XJH->XCH", inverse, ac * before)
    r_prime = jnp.einsum("XCJ,XJE->XCE", inverse, jnp.einsum("XCJ,XJE->XCE", A_ak, vc))
    b_end = bc * end
    M = across[..., None] * jnp.eye(H, dtype=across.dtype) + jnp.einsum("XCH,XCI->XHI", b_end, w)
    written = jnp.einsum("XCH,XCE->XHE", b_end, r_prime) + jnp.einsum("XCH,XCE->XHE", kc * end, vc)

    Z = B * K * G
    state = jnp.zeros((Z, H, E), jnp.float32) if state is None else state.reshape(Z, H, E)

    def advance(S, x):
        M_c, written_c = x
        return jnp.einsum("ZHI,ZIE->ZHE", M_c, S) + written_c, S

    final, S_in = lax.scan(advance, state, (M.reshape(U, Z, H, H), written.reshape(U, Z, H, E)))
    S_in = S_in.reshape(X, H, E)
    r = r_prime + jnp.einsum("XCH,XHE->XCE", w, S_in)
    out = jnp.einsum("XCH,XHE->XCE", qc * start, S_in)
    out = out + jnp.einsum("XCJ,XJE->XCE", A_qb, r) + jnp.einsum("XCJ,XJE->XCE", A_qk, vc)
    out = jnp.moveaxis(out.reshape(U, B, K, G, C, E), (0, 4), (1, 2))  # [B,U,C,K,G,E]
    return out.reshape(B, U * C, K, G, E)[:, :T], final.reshape(B, K, G, H, E)
