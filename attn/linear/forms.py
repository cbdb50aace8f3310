"""The three forms of causal linear attention (and the non-causal global sums).

Internal to ``attn.linear``, which validates the arguments, applies the scale
and the segment rules, and normalizes. Every form takes float32 inputs shaped
for GQA and returns the numerator ``[B,T,K,G,E]``, the denominator
``[B,T,K,G]`` and the final state (kv ``[B,K,G,F,E]``, z ``[B,K,G,F]``).

``key_real`` ``[B,T]`` bool (or None: all real) zeroes the features of keys
that must not enter the state (padding); their log decay is 0 already, so they
leave the state exactly as it was. ``log_a`` ``[B,T,K,G]`` (or None) is the
total log decay, ``-inf`` where the state is erased (a zero gate or a segment
boundary). ``neg`` (same shape as ``log_a``, or None: all positive) is 1.0
where that token's gate is negative (``attn.linear_attention``'s
``negative_gates``): the gate is ``-exp(log_a)``, and a product of gates
carries ``(-1)`` to the number of negative ones in its range
(``decay_matrix``).

Axis letters besides the vocabulary (``C`` is the query position inside a
chunk): ``U`` the chunk index, ``J`` the key position inside a chunk, ``X`` a
flattened batch of matmuls (``(B,K)`` in the parallel form, ``(U,B,K)`` in the
chunkwise one) and ``Y`` the flattened ``(U,B,K,G)``. Batching every product
over one flattened leading axis matters: XLA's CPU backend runs that form
several times faster than the same einsum with several batch axes.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
from jax import lax


def _range_sums(x, fill: float):
    """Range sums ``[..., C] -> [..., C, C]``: ``sum_{r=j+1..i} x[r]`` at ``[i, j]``, j <= i.

    Entries above the diagonal are ``fill``.

    Each entry is summed over its own range (masked cumsum), never as a
    difference of totals.
    """
    C = x.shape[-1]
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    terms = jnp.where(i > j, jnp.broadcast_to(x[..., :, None], (*x.shape, C)), 0.0)
    sums = jnp.cumsum(terms, axis=-2)
    return jnp.where(i >= j, sums, fill)


def segsum(log_a):
    """Segment sums of log decays: ``[..., C] -> [..., C, C]``.

    ``out[i, j] = sum_{r=j+1..i} log_a[r]`` for ``j <= i`` and ``-inf`` above the
    diagonal, so ``exp(out)`` is the causal decay matrix.
    """
    return _range_sums(log_a, -jnp.inf)


def parity_sign(count):
    """``(-1) ** count`` for counts of negative gates (whole numbers, exact in float32)."""
    return 1.0 - 2.0 * jnp.mod(lax.stop_gradient(count), 2.0)


def signed(decay, neg):
    """A decay magnitude times the sign of one gate: ``neg`` 1. where that gate is negative."""
    return decay if neg is None else decay * (1.0 - 2.0 * lax.stop_gradient(neg))


def decay_matrix(log_a, neg=None):
    """The causal decay matrix ``[..., C, C]`` from log magnitudes and signs ``[..., C]``.

    A product of signed gates is ``exp`` of the range sum of their log
    magnitudes (<= 0: nothing overflows) times ``(-1)`` to the number of
    negative gates in the range, counted by the same masked cumsum (whole
    numbers, exact in float32 up to 2**24). Zero above the diagonal.
    """
    weights = jnp.exp(segsum(log_a))
    if neg is not None:
        weights = weights * parity_sign(_range_sums(neg, 0.0))
    return weights


def _weigh_causal(scores, log_a, neg=None):
    """Applies the causal decay matrix to ``scores [..., C, C]``.

    Without decay (``log_a`` None) it is the causal mask, applied as a select
    that fuses into its neighbours (no ``[C, C]`` array is built); with log
    decays ``[..., C]`` (and the gates' signs ``neg``) it is ``decay_matrix``.

    Returns:
        ``(weighted scores, weights [..., C, C] or None)``.
    """
    C = scores.shape[-1]
    if log_a is None:
        causal = lax.broadcasted_iota(jnp.int32, (C, C), 0) >= lax.broadcasted_iota(
            jnp.int32, (C, C), 1
        )
        return jnp.where(causal, scores, 0.0), None
    weights = decay_matrix(log_a, neg)
    return scores * weights, weights


def _mask_keys(kf, key_real):
    """Zeroes the features ``kf [B,S,K,F]`` of keys that are not real (``[B,S]``)."""
    return kf if key_real is None else jnp.where(key_real[:, :, None, None], kf, 0.0)


def parallel(qf, kf, v, log_a, kv0, z0, causal: bool, key_real=None, visible=None, neg=None):
    """Materialized ``[T, S]`` form, the reference.

    qf ``[B,T,K,G,F]``, kf ``[B,S,K,F]``, v ``[B,S,K,E]``, log_a ``[B,T,K,G]`` or
    None, ``visible`` ``[B,T,S]`` bool or None: an extra key mask (segments,
    when not causal).
    """
    B, T, K, G, F = qf.shape
    S, E = v.shape[1], v.shape[-1]
    kf = _mask_keys(kf, key_real)
    q_rows = qf.transpose(0, 2, 3, 1, 4).reshape(B * K, G, T, F)
    k_rows = kf.transpose(0, 2, 1, 3).reshape(B * K, S, F)
    scores = jnp.einsum("XGTF,XSF->XGTS", q_rows, k_rows).reshape(B, K, G, T, S)
    if visible is not None:
        scores = jnp.where(visible[:, None, None], scores, 0.0)
    q_weight = None  # decay of the initial state seen by each query, [B,T,K,G]
    end_weight = None  # decay from each key to the end, [B,S,K,G]
    chain = 1.0  # decay of the initial state across the whole sequence
    if causal:
        log_a_t = None if log_a is None else log_a.transpose(0, 2, 3, 1)  # [B,K,G,T]
        neg_t = None if neg is None else neg.transpose(0, 2, 3, 1)
        scores, weights = _weigh_causal(scores, log_a_t, neg_t)
        if log_a is not None:
            q_weight = jnp.exp(jnp.cumsum(log_a, axis=1))
            if neg is not None:
                q_weight = q_weight * parity_sign(jnp.cumsum(neg, axis=1))
            end_weight = jnp.moveaxis(weights[..., -1, :], -1, 1)
            chain = q_weight[:, -1][..., None]
    v_rows = v.transpose(0, 2, 1, 3).reshape(B * K, S, E)
    num = jnp.einsum("XGTS,XSE->XGTE", scores.reshape(B * K, G, T, S), v_rows)
    num = num.reshape(B, K, G, T, E).transpose(0, 3, 1, 2, 4)
    den = jnp.sum(scores, axis=-1).transpose(0, 3, 1, 2)
    q_init = qf if q_weight is None else qf * q_weight[..., None]
    num = num + jnp.einsum("BTKGF,BKGFE->BTKGE", q_init, kv0)
    den = den + jnp.einsum("BTKGF,BKGF->BTKG", q_init, z0)
    if end_weight is None:
        kv = kv0 + jnp.einsum("BSKF,BSKE->BKFE", kf, v)[:, :, None]
        z = z0 + jnp.sum(kf, axis=1)[:, :, None]
    else:
        kf_end = kf[:, :, :, None] * end_weight[..., None]  # [B,S,K,G,F]
        kv = chain[..., None] * kv0 + jnp.einsum("BSKGF,BSKE->BKGFE", kf_end, v)
        z = chain * z0 + jnp.sum(kf_end, axis=1)
    return num, den, (kv, z)


def global_sums(qf, kf, v, kv0, z0):
    """Non-causal form shared by "recurrent" and "chunkwise": one global state, read by all."""
    kv = kv0 + jnp.einsum("BSKF,BSKE->BKFE", kf, v)[:, :, None]
    z = z0 + jnp.sum(kf, axis=1)[:, :, None]
    num = jnp.einsum("BTKGF,BKGFE->BTKGE", qf, kv)
    den = jnp.einsum("BTKGF,BKGF->BTKG", qf, z)
    return num, den, (kv, z)


def step(carry, q_t, k_t, v_t, log_a_t, phi, valid=None, neg_t=None):
    """One token. q_t ``[B,K,G,H]``, k_t ``[B,K,H]``, v_t ``[B,K,E]``, log_a_t ``[B,K,G]``.

    Features are computed here rather than before the scan so the scan keeps
    H-sized inputs per step instead of F-sized ones (F = 1 + H + H^2 for taylor).
    ``valid`` ``[B]`` bool (or None) zeroes the key of a padding step.
    """
    kv, z = carry
    qf = phi(q_t)
    kf = phi(k_t)
    if valid is not None:
        kf = jnp.where(valid[:, None, None], kf, 0.0)
    if log_a_t is not None:
        a = signed(jnp.exp(log_a_t), neg_t)
        kv = kv * a[..., None, None]
        z = z * a[..., None]
    kv = kv + jnp.einsum("BKF,BKE->BKFE", kf, v_t)[:, :, None]
    z = z + kf[:, :, None]
    num = jnp.einsum("BKGF,BKGFE->BKGE", qf, kv)
    den = jnp.einsum("BKGF,BKGF->BKG", qf, z)
    return (kv, z), (num, den)


def _pieces(T: int) -> tuple[int, int, int]:
    """``(piece length, number of pieces, time padding)`` of ``scan_in_pieces`` over T."""
    piece = math.isqrt(T - 1) + 1  # ceil(sqrt(T)) for T >= 1
    num_pieces = -(-T // piece)
    return piece, num_pieces, num_pieces * piece - T


def exclusive_suffix(g, axis: int):
    """``out[j] = sum_{l > j} g[l]`` along ``axis``, accumulated (never a difference)."""
    total = jnp.flip(jnp.cumsum(jnp.flip(g, axis), axis), axis)  # sum_{l >= j}
    rest = lax.slice_in_dim(total, 1, None, axis=axis)
    pad = [(0, 0)] * g.ndim
    pad[axis % g.ndim] = (0, 1)
    return jnp.pad(rest, pad)


def scan_tokens(step, xs, state, shape: tuple):
    """``step(S, *x_t) -> (S, out_t)`` scanned over the tokens of ``xs`` (``[B,T,...]``
    arrays, T on axis 1) from ``state`` (zeros of ``shape`` if None), O(sqrt(T)) states
    kept for the backward pass (``scan_in_pieces``). Returns ``(out, final)``."""
    if state is None:
        state = jnp.zeros(shape, jnp.float32)
    final, out = scan_in_pieces(lambda S, x: step(S, *x), state, xs, xs[0].shape[1])
    return out, final


def scan_in_pieces(one_step, init, xs, T: int):
    """``lax.scan`` of ``one_step`` over T tokens with memory O(sqrt(T)) in the backward pass.

    ``xs`` is a tuple of ``[B,T,...]`` arrays (or None); ``one_step(carry, x_t)``
    returns ``(carry, y_t)`` with ``y_t`` a pytree of ``[B,...]``. The tokens are
    split into about sqrt(T) pieces of about sqrt(T) steps; the outer scan stores
    only the carry at piece boundaries and each piece's inner scan is
    rematerialized in the backward pass, so backward memory is O(sqrt(T))
    carries instead of T. Time padding (up to whole pieces) is zeros (False for
    bools); the caller makes a zero token a no-op.

    Returns:
        ``(final carry, ys)`` with ys ``[B,T,...]``.
    """
    piece, num_pieces, pad = _pieces(T)

    def time_major(x):
        x = jnp.moveaxis(x, 1, 0)
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_pieces, piece, *x.shape[1:])

    @jax.checkpoint
    def run_piece(carry, xs_piece):
        return lax.scan(one_step, carry, xs_piece)

    xs = tuple(None if x is None else time_major(x) for x in xs)
    carry, ys = lax.scan(run_piece, init, xs)

    def batch_major(y):
        return jnp.moveaxis(y.reshape(num_pieces * piece, *y.shape[2:])[:T], 0, 1)

    return carry, jax.tree.map(batch_major, ys)


def recurrent(q, k, v, log_a, kv0, z0, phi, key_real=None, neg=None):
    """Scan over tokens (``scan_in_pieces``).

    q ``[B,T,K,G,H]``, k ``[B,T,K,H]``, v ``[B,T,K,E]`` float32.
    """
    B, T = q.shape[:2]
    if key_real is None and _pieces(T)[2]:
        key_real = jnp.ones((B, T), bool)  # time padding is False: phi(0) never enters

    def one_step(carry, x):
        q_t, k_t, v_t, log_a_t, valid_t, neg_t = x
        return step(carry, q_t, k_t, v_t, log_a_t, phi, valid_t, neg_t)

    xs = (q, k, v, log_a, key_real, neg)
    state, (num, den) = scan_in_pieces(one_step, (kv0, z0), xs, T)
    return num, den, state


def _split_chunks(x, U: int, C: int):
    """``[B,T,...] -> [B,U,C,...]``, zero-padding T to U * C."""
    x = jnp.pad(x, [(0, 0), (0, U * C - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], U, C, *x.shape[2:])


def chunkwise(q, k, v, log_a, kv0, z0, phi, chunk_size: int, key_real=None, neg=None):
    """Chunks of C tokens.

    q ``[B,T,K,G,H]``, k ``[B,T,K,H]``, v ``[B,T,K,E]`` float32, log_a
    ``[B,T,K,G]`` or None; kv0 ``[B,K,G,F,E]`` and z0 ``[B,K,G,F]``, or None for
    a zero state. The feature map is applied after the inputs are rearranged
    into chunks, so that it fuses with that copy (both are memory-bound).

    Inside a chunk: the masked quadratic product (matmuls over C x C). Across
    chunks: each chunk's contribution to the state is computed in parallel,
    then a scan over chunks (elementwise only) yields the state entering each
    chunk, which all its queries read with one more matmul. A segment boundary
    is a log decay of ``-inf``: it zeroes the intra-chunk weights across it, the
    decay that carries the state over its chunk, and the weight with which the
    queries after it read the entering state, so a segment spanning several
    chunks, or several segments in one chunk, are all exact.

    Layout: chunk-major ``[U,B,K,G,C,.]`` with U chunks, so the scan over
    chunks needs no transpose; every product is batched over ``X = (U,B,K)``
    with the G query heads of a kv head as rows of one matrix.
    """
    B, T, K, G, _ = q.shape
    E = v.shape[-1]
    C = min(chunk_size, T)  # a chunk longer than T is the parallel form
    U = -(-T // C)
    X = U * B * K
    qf = phi(_split_chunks(q, U, C).transpose(1, 0, 3, 4, 2, 5))  # [U,B,K,G,C,F]
    kf = phi(_split_chunks(k, U, C).transpose(1, 0, 3, 2, 4))  # [U,B,K,J,F]
    F = kf.shape[-1]
    if U * C > T or key_real is not None:
        # Padding keys get zero features (and log decay 0): states and real outputs
        # are unchanged. Padding queries compute rows that are sliced off.
        real = jnp.ones((B, T), bool) if key_real is None else key_real
        real = _split_chunks(real, U, C).transpose(1, 0, 2)  # [U,B,J], False past T
        kf = jnp.where(real[:, :, None, :, None], kf, 0.0)
    v = _split_chunks(v, U, C).transpose(1, 0, 3, 2, 4)  # [U,B,K,J,E]
    if log_a is not None:
        log_a = _split_chunks(log_a, U, C).transpose(1, 0, 3, 4, 2)  # [U,B,K,G,C]
    if neg is not None:
        neg = _split_chunks(neg, U, C).transpose(1, 0, 3, 4, 2)  # 0 (positive) past T
    scores = jnp.einsum("XGCF,XJF->XGCJ", qf.reshape(X, G, C, F), kf.reshape(X, C, F))
    scores, weights = _weigh_causal(scores.reshape(U, B, K, G, C, C), log_a, neg)
    num = jnp.einsum("XGCJ,XJE->XGCE", scores.reshape(X, G, C, C), v.reshape(X, C, E))
    num = num.reshape(U, B, K, G, C, E)
    den = jnp.sum(scores, axis=-1)
    if log_a is None:
        num_in, den_in, (kv, z) = _chunk_inputs_shared(qf, kf, v, kv0, z0)
    else:
        if kv0 is None:
            kv0 = jnp.zeros((B, K, G, F, E), jnp.float32)
            z0 = jnp.zeros((B, K, G, F), jnp.float32)
        inputs = (qf, kf, v, log_a, weights, kv0, z0, neg)
        num_in, den_in, (kv, z) = _chunk_inputs_decayed(*inputs)
    chex.assert_equal_shape([num, num_in])
    chex.assert_equal_shape([den, den_in])
    chex.assert_shape([kv, z], [(B, K, G, F, E), (B, K, G, F)])
    num = (num + num_in).transpose(1, 0, 4, 2, 3, 5).reshape(B, U * C, K, G, E)
    den = (den + den_in).transpose(1, 0, 4, 2, 3).reshape(B, U * C, K, G)
    return num[:, :T], den[:, :T], (kv, z)


def _chunk_inputs_shared(qf, kf, v, kv0, z0):
    """Without decay: what each chunk's queries read from the state entering the chunk.

    qf ``[U,B,K,G,C,F]``, kf ``[U,B,K,J,F]``, v ``[U,B,K,J,E]``. That state is
    the initial one plus the sum over earlier chunks, which is the same for the
    G query heads of a kv head: it is summed per kv head, and the initial
    state is read separately (skipped when None).
    """
    U, B, K, G, C, F = qf.shape
    E = v.shape[-1]
    X = U * B * K
    d_kv = jnp.einsum("XJF,XJE->XFE", kf.reshape(X, C, F), v.reshape(X, C, E))
    d_kv = d_kv.reshape(U, B, K, F, E)
    d_z = jnp.sum(kf, axis=3)  # [U,B,K,F]

    def advance(total, d):
        return jax.tree.map(jnp.add, total, d), total

    zeros = (jnp.zeros((B, K, F, E), jnp.float32), jnp.zeros((B, K, F), jnp.float32))
    (kv, z), (kv_before, z_before) = lax.scan(advance, zeros, (d_kv, d_z))
    num_in = jnp.einsum("XGCF,XFE->XGCE", qf.reshape(X, G, C, F), kv_before.reshape(X, F, E))
    num_in = num_in.reshape(U, B, K, G, C, E)
    den_in = jnp.einsum("UBKGCF,UBKF->UBKGC", qf, z_before)
    kv = jnp.broadcast_to(kv[:, :, None], (B, K, G, F, E))
    z = jnp.broadcast_to(z[:, :, None], (B, K, G, F))
    if kv0 is not None:
        num_in = num_in + jnp.einsum("UBKGCF,BKGFE->UBKGCE", qf, kv0)
        den_in = den_in + jnp.einsum("UBKGCF,BKGF->UBKGC", qf, z0)
        kv, z = kv0 + kv, z0 + z
    return num_in, den_in, (kv, z)


def _chunk_inputs_decayed(qf, kf, v, log_a, weights, kv0, z0, neg=None):
    """With decay: what each chunk's queries read from the decayed state entering the chunk.

    qf ``[U,B,K,G,C,F]``, kf ``[U,B,K,J,F]``, v ``[U,B,K,J,E]``, log_a
    ``[U,B,K,G,C]``. ``weights[..., i, j]`` is the decay from key j to query i
    within the chunk, so its last row is the decay from each key to the
    chunk's end and its first column, times ``a_0``, the decay from the chunk's
    start through query i.
    """
    U, B, K, G, C, F = qf.shape
    E = v.shape[-1]
    X = U * B * K
    end_weight = weights[..., -1, :]  # [U,B,K,G,J]
    # Signed with the gates: a chunk's decay may be negative, and the scan
    # below multiplies by it as it is.
    first = signed(jnp.exp(log_a[..., :1]), None if neg is None else neg[..., :1])
    start_weight = weights[..., :, 0] * first  # [U,B,K,G,C]
    kf_end = kf[:, :, :, None] * end_weight[..., None]  # [U,B,K,G,J,F]
    d_kv = jnp.einsum("XGJF,XJE->XGFE", kf_end.reshape(X, G, C, F), v.reshape(X, C, E))
    d_kv = d_kv.reshape(U, B, K, G, F, E)
    d_z = jnp.sum(kf_end, axis=-2)  # [U,B,K,G,F]
    # Zero when the chunk holds a segment boundary (or a zero gate): the
    # carried state stops there, as it would for a segment run alone.
    chunk_decay = start_weight[..., -1]  # [U,B,K,G]

    def advance(state, x):
        kv, z = state
        d_kv_c, d_z_c, decay_c = x
        new = (decay_c[..., None, None] * kv + d_kv_c, decay_c[..., None] * z + d_z_c)
        return new, state

    (kv, z), (kv_in, z_in) = lax.scan(advance, (kv0, z0), (d_kv, d_z, chunk_decay))
    q_in = qf * start_weight[..., None]
    num_in = jnp.einsum(
        "YCF,YFE->YCE", q_in.reshape(X * G, C, F), kv_in.reshape(X * G, F, E)
    ).reshape(U, B, K, G, C, E)
    den_in = jnp.einsum("UBKGCF,UBKGF->UBKGC", q_in, z_in)
    return num_in, den_in, (kv, z)
