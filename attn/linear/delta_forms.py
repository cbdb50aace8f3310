"""The two forms of the delta rule: a scan over tokens and chunks in the WY (UT) form.

Internal to ``attn.linear.delta``, which validates, scales q, applies the
segment rules and casts. Both forms take float32 inputs laid out for grouped
value heads and compute the same function:

    q, k    ``[B,T,K,H]``      K query/key heads
    v       ``[B,T,K,G,E]``    G value heads per query/key head (N = K G)
    beta    ``[B,T,K,G]``      0 at padding and time padding: no write
    log_g   None, ``[B,T,K,G]`` (one gate per head) or ``[B,T,K,G,H]`` (per key
            channel); ``-inf`` erases the state (a zero gate, a segment start)
    state   ``[B,K,G,H,E]`` or None (zeros)

and return ``out [B,T,K,G,E]`` and the final state ``[B,K,G,H,E]``.

Axis letters besides the vocabulary: ``U`` the chunk index, ``C``/``J`` query
and key positions inside a chunk, ``Y`` a flattened batch of matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from attn.linear.forms import exclusive_suffix, scan_tokens, segsum


def _decay(S, a):
    """``diag(a) S`` for states ``S [..., H, E]`` and decays a ``[...]`` (per head),
    ``[..., H]`` (per key channel) or None (no decay)."""
    if a is None:
        return S
    return S * (a[..., None, None] if a.ndim == S.ndim - 2 else a[..., None])


def step(state, q_t, k_t, v_t, beta_t, log_g_t):
    """One token: decay, delta write, read. q_t, k_t ``[B,K,H]``, v_t ``[B,K,G,E]``.

    Returns ``(state [B,K,G,H,E], out_t [B,K,G,E])``.
    """
    state = _decay(state, None if log_g_t is None else jnp.exp(log_g_t))
    predicted = jnp.einsum("BKH,BKGHE->BKGE", k_t, state)  # S^T k
    u = beta_t[..., None] * (v_t - predicted)
    state = state + jnp.einsum("BKH,BKGE->BKGHE", k_t, u)
    return state, jnp.einsum("BKH,BKGHE->BKGE", q_t, state)


def recurrent(q, k, v, beta, log_g, state):
    """A ``lax.scan`` over tokens, O(sqrt(T)) states kept for the backward pass."""
    B, _, K, H = q.shape
    shape = (B, K, v.shape[3], H, v.shape[4])  # [B,K,G,H,E]
    return scan_tokens(step, (q, k, v, beta, log_g), state, shape)


def _chunks(x, U: int, C: int):
    """``[B,T,K,...] -> [U,B,K,C,...]`` chunk-major, zero-padding T to U C."""
    x = jnp.pad(x, [(0, 0), (0, U * C - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], U, C, *x.shape[2:]), (1, 2), (0, 3))


def _flat(x):
    """``[U,B,K,G,C,...] -> [U,Z,C,...]`` with Z = B K G, the batch of every product."""
    return x.reshape(x.shape[0], -1, *x.shape[4:])


def _bmm(spec: str, a, b):
    """A batched matmul over the leading ``[U,Z]`` axes flattened into one.

    XLA's CPU backend runs a product batched over one flattened axis several
    times faster than the same einsum over several batch axes.
    """
    U, Z = a.shape[:2]
    out = jnp.einsum(spec, a.reshape(U * Z, *a.shape[2:]), b.reshape(U * Z, *b.shape[2:]))
    return out.reshape(U, Z, *out.shape[1:])


class _Decays:
    """The decays of each chunk, from its log gates ``[U,Z,C]`` or ``[U,Z,C,H]`` (or None).

    Every decay is ``exp`` of a range sum of log gates (<= 0), accumulated
    over its range, never a difference of running totals: a ``-inf`` gate
    gives zeros, never NaN, and nothing overflows.

    Attributes:
      start: ``[U,Z,C(,H)]`` decay from the chunk's start through token i.
      end: ``[U,Z,C(,H)]`` decay from token j to the chunk's end.
      chunk: ``[U,Z(,H)]`` decay across the chunk.
    """

    def __init__(self, log_g):
        self.log_g = log_g
        self.per_channel = log_g is not None and log_g.ndim == 4
        if log_g is None:
            self.start = self.end = self.chunk = None
            return
        self.start = jnp.exp(jnp.cumsum(log_g, axis=2))
        self.end = jnp.exp(exclusive_suffix(log_g, 2))
        self.chunk = jnp.exp(jnp.sum(log_g, axis=2))

    def products(self, a, b):
        """``[U,Z,C,J]``: ``sum_h a_ih b_jh exp(sum_{l=j+1..i} g_lh)`` for ``j <= i``
        (entries above the diagonal are not defined); a, b ``[U,Z,C,H]``."""
        dots = None if self.per_channel else _bmm("XCH,XJH->XCJ", a, b)
        if self.log_g is None:
            return dots
        if not self.per_channel:
            return dots * jnp.exp(segsum(self.log_g))
        return _channel_products(a, b, self.log_g)


def _channel_products(a, b, log_g):
    """``Decays.products`` with a gate per key channel: a, b, ``log_g`` ``[U,Z,C,H]``."""
    U, Z, C, H = a.shape
    flat = (x.reshape(U * Z, C, H) for x in (a, b, log_g))
    return _halves(*flat).reshape(U, Z, C, C)


def _halves(a, b, log_g):
    """``_channel_products`` on ``[X,C,H]`` arrays (rank 3 at every depth: XLA's CPU
    backend refuses arrays of rank 8 and more in some fusions).

    The decay ``exp(gamma_i - gamma_j)`` differs per channel, so the product is
    no single matmul, and ``[C, C, H]`` exact decays cost C H memory per token.
    Instead the chunk is halved recursively: the two diagonal halves are
    products of the same kind (computed together), and the block of queries in
    the second half against keys in the first is one matmul,
    ``(a_i * exp(sum_{l=h..i} g_l)) . (b_j * exp(sum_{l=j+1..h-1} g_l))``, whose
    two decays (from the split point h to i, from j to h) are range sums <= 0:
    every factor is at most 1, so nothing overflows (unlike ``e^{gamma_i}`` times
    ``e^{-gamma_j}``), and memory stays O(C H) per level, log2(C) levels.
    """
    X, C, _ = a.shape
    if C == 1:
        return jnp.sum(a * b, axis=-1)[..., None]
    h = C - C // 2
    first = [x[:, :h] for x in (a, b, log_g)]
    second = [x[:, h:] for x in (a, b, log_g)]
    if h == C - h:  # both halves in one call, stacked along the batch
        both = _halves(*(jnp.concatenate(pair) for pair in zip(first, second, strict=True)))
        top, bottom = both[:X], both[X:]
    else:
        top, bottom = _halves(*first), _halves(*second)
    left = second[0] * jnp.exp(jnp.cumsum(second[2], axis=1))
    right = first[1] * jnp.exp(exclusive_suffix(first[2], 1))
    below = jnp.einsum("XCH,XJH->XCJ", left, right)
    upper = jnp.concatenate([top, jnp.zeros((*top.shape[:-1], C - h), top.dtype)], -1)
    return jnp.concatenate([upper, jnp.concatenate([below, bottom], -1)], -2)


def _times(x, w):
    """``x [U,Z,C,H]`` times decays ``[U,Z,C]`` or ``[U,Z,C,H]`` (None: x)."""
    if w is None:
        return x
    return x * (w if w.ndim == x.ndim else w[..., None])


# Blocks up to this size are inverted by forward substitution, larger ones
# by halves (the merge is two matmuls).
SUBSTITUTION_BLOCK = 16


def _substitute(n):
    """``(I + n)^{-1}`` for strictly lower ``n [X,C,C]``, row by row (C <= 16).

    Row i of the inverse is ``e_i - sum_{j<i} n_ij row_j``: C - 1 small
    matrix-vector products, unrolled.
    """
    C = n.shape[-1]
    eye = jnp.eye(C, dtype=n.dtype)
    rows = [jnp.broadcast_to(eye[0], (n.shape[0], C))]
    for i in range(1, C):
        done = jnp.stack(rows, axis=-2)  # [..., i, C]
        rows.append(eye[i] - jnp.einsum("Xj,Xjc->Xc", n[:, i, :i], done))
    return jnp.stack(rows, axis=-2)


def _invert(n):
    """``(I + n)^{-1}`` for strictly lower ``n [X,C,C]``: blockwise by halves.

    ``[[A, 0], [B, D]]^{-1} = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``; the two
    diagonal halves are inverted in one call (stacked along X, so the rank
    stays 3) when they have the same size.
    """
    X, C, _ = n.shape
    if C <= SUBSTITUTION_BLOCK:
        return _substitute(n)
    h = C - C // 2
    top, bottom, below = n[:, :h, :h], n[:, h:, h:], n[:, h:, :h]
    if C % 2 == 0:
        both = _invert(jnp.concatenate([top, bottom]))
        t_top, t_bottom = both[:X], both[X:]
    else:
        t_top, t_bottom = _invert(top), _invert(bottom)
    t_below = -(t_bottom @ below @ t_top)
    upper = jnp.concatenate([t_top, jnp.zeros((X, h, C - h), n.dtype)], -1)
    return jnp.concatenate([upper, jnp.concatenate([t_below, t_bottom], -1)], -2)


@jax.custom_vjp
def unit_lower_inverse(n):
    """``(I + n)^{-1}`` for strictly lower triangular ``n [..., C, C]``, made of matmuls.

    Used instead of ``jax.scipy.linalg.solve_triangular``: on CPU its LAPACK
    kernel splits a batch over XLA's thread pool from inside that pool and can
    deadlock when two such solves run at once (seen in jaxlib 0.10.1 on 2 cores,
    about one run in three of the chunkwise backward pass). Matmuls also suit
    accelerators better than a triangular solve. The backward pass is the
    closed form ``dn = -tril(X^T dX X^T, -1)`` with ``X`` the inverse, so
    nothing of the substitution is stored.
    """
    return _inverse_fwd(n)[0]


def _inverse_fwd(n):
    x = _invert(n.reshape(-1, *n.shape[-2:])).reshape(n.shape)
    return x, x


def _inverse_bwd(x, dx):
    C = x.shape[-1]
    xt = jnp.swapaxes(x, -1, -2)
    return (jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), -(xt @ dx @ xt), 0.0),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def _wy(k, v, beta, decays: _Decays):
    """The UT transform of each chunk: ``W [U,Z,C,H]`` and ``U' [U,Z,C,E]``.

    With ``A = tril(diag(beta) (K K^T * decay), -1)``, the chunk's writes are
    ``u = U' - W S`` for the state S entering it, where
    ``U' = (I + A)^{-1} diag(beta) V`` and ``W = (I + A)^{-1} diag(beta) (K * start
    decay)``: one triangular inverse per chunk instead of C dependent steps.
    """
    C = k.shape[2]
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    A = jnp.where(strict, beta[..., None] * decays.products(k, k), 0.0)
    inverse = unit_lower_inverse(A)
    w = _bmm("XCJ,XJH->XCH", inverse, beta[..., None] * _times(k, decays.start))
    return w, _bmm("XCJ,XJE->XCE", inverse, beta[..., None] * v)


def chunkwise(q, k, v, beta, log_g, state, chunk_size: int):
    """Chunks of C tokens: the WY form inside, a scan carrying the state across.

    Inside a chunk everything is parallel: ``W`` and ``U'`` (``_wy``), the
    decayed query-key products and the decayed queries and keys. The scan over
    chunks only advances the state,

        u = U' - W S,     S <- decay_chunk S + (K * end decay)^T u,

    and the outputs ``O = (Q * start decay) S + (Q K^T * decay) u`` are read
    afterwards with the state entering each chunk, so the scan keeps one state
    per chunk for the backward pass (T / C of them), never one per token.

    Layout: ``[U,Z,C,...]`` with Z = B K G (q and k broadcast to their G value
    heads), so every product is one matmul batched over ``U Z``.
    """
    B, T, K, H = q.shape
    G, E = v.shape[3:]
    C = min(chunk_size, T)
    U = -(-T // C)

    def per_value_head(x):  # [B,T,K,...] -> [U,Z,C,...]
        x = _chunks(x, U, C)
        return _flat(jnp.broadcast_to(x[:, :, :, None], (*x.shape[:3], G, *x.shape[3:])))

    qc, kc = per_value_head(q), per_value_head(k)
    vc, betac = (_flat(jnp.moveaxis(_chunks(x, U, C), 3, 4)) for x in (v, beta))
    log_gc = None if log_g is None else _flat(jnp.moveaxis(_chunks(log_g, U, C), 3, 4))
    decays = _Decays(log_gc)
    w, u_prime = _wy(kc, vc, betac, decays)
    k_end = _times(kc, decays.end)
    state = jnp.zeros((B * K * G, H, E), jnp.float32) if state is None else state.reshape(-1, H, E)

    def advance(S, x):
        w_c, u_prime_c, k_end_c, decay_c = x
        u = u_prime_c - jnp.einsum("ZCH,ZHE->ZCE", w_c, S)
        written = jnp.einsum("ZJH,ZJE->ZHE", k_end_c, u)
        return _decay(S, decay_c) + written, (S, u)

    final, (S_in, u) = lax.scan(advance, state, (w, u_prime, k_end, decays.chunk))
    causal = jnp.tril(jnp.ones((C, C), bool))
    scores = jnp.where(causal, decays.products(qc, kc), 0.0)
    out = _bmm("XCH,XHE->XCE", _times(qc, decays.start), S_in)
    out = out + _bmm("XCJ,XJE->XCE", scores, u)  # [U,Z,C,E]
    out = jnp.moveaxis(out.reshape(U, B, K, G, C, E), (0, 4), (1, 2))  # [B,U,C,K,G,E]
    return out.reshape(B, U * C, K, G, E)[:, :T], final.reshape(B, K, G, H, E)
