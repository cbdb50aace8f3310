"""Float64 references of the fixed-state families, written from their papers' equations.

One reference per family, as plainly as the equations read (a scan over
tokens, or the masked quadratic sum), never the forms' algorithms: the tests,
``bench/_delta.py`` and the device numerics (``bench/_device_numerics.py``)
compare every form with these. They are plain JAX, so ``jax.grad`` of them is
the gradient oracle; run them on float64 arrays under ``jax.enable_x64(True)``.
Segments are not theirs to know: a caller runs a segment alone.

Axes as ``attn``'s: value head n reads and writes with query/key head ``n // G``
(``G = N // K``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "delta_rule",
    "dplr_delta_rule",
    "fenwick_levels",
    "gated_linear",
    "log_linear_attention",
    "log_linear_delta_rule",
]


def gated_linear(qf, kf, v, log_a, *, normalize: bool, eps: float = 1e-6):
    """Causal linear attention with per-token gates, quadratic: ``out_t = sum_{s<=t}
    (qf_t . kf_s) a_{s+1..t} v_s`` (over the same sum without v, plus eps, if normalized),
    and the final state ``kv = sum_s a_{s+1..T} kf_s v_s^T``, ``z = sum_s a_{s+1..T} kf_s``.

    qf, kf ``[B,T,N,F]`` (features, per head), v ``[B,T,N,E]``, log_a ``[B,T,N]``.
    """
    T = qf.shape[1]
    cum = jnp.cumsum(log_a, axis=1)
    causal = np.tril(np.ones((T, T), bool))[None, :, :, None]
    decay = jnp.exp(jnp.where(causal, cum[:, :, None] - cum[:, None], -jnp.inf))  # [B,T,S,N]
    a = jnp.einsum("BTNF,BSNF->BTSN", qf, kf) * decay
    out = jnp.einsum("BTSN,BSNE->BTNE", a, v)
    if normalize:
        out = out / (a.sum(2)[..., None] + eps)
    last = jnp.exp(cum[:, -1:] - cum)  # [B,S,N]
    kv = jnp.einsum("BSN,BSNF,BSNE->BNFE", last, kf, v)
    return out, kv, jnp.einsum("BSN,BSNF->BNF", last, kf)


def delta_rule(q, k, v, beta, log_gates=None, *, initial_state=None, scale=None):
    """The (gated) delta rule as a scan over tokens, from ``attn.linear.delta``'s equations:
    decay ``S`` by ``exp(g_t)`` (per head or per key channel), then for each of the token's
    n keys ``u = beta (v - S^T k)``, ``S += k u^T``, then read ``S^T (scale q)`` (``scale``
    default ``1/sqrt(H)``); from ``initial_state [B,N,H,E]`` (zeros if None). Returns the
    outputs ``[B,T,N,E]`` and the final state.

    q ``[B,T,K,H]``; for DeltaProduct (n keys a token) k ``[B,T,n,K,H]``, v ``[B,T,n,N,E]``,
    beta ``[B,T,n,N]``, else without the n axis; log_gates None, ``[B,T,N]`` or
    ``[B,T,N,H]``; value head n reads q/k head ``n // G``.
    """
    steps = k.ndim - q.ndim + 1
    if steps == 1:
        k, v, beta = k[:, :, None], v[:, :, None], beta[:, :, None]
    B, _, K, H = q.shape
    N, E = v.shape[-2:]
    G = N // K
    qn = jnp.repeat(q, G, axis=2) * (H**-0.5 if scale is None else scale)
    kn = jnp.repeat(k, G, axis=3)

    def step(S, x):
        q_t, k_t, v_t, b_t, g_t = x
        if g_t is not None:
            a = jnp.exp(g_t)
            S = S * (a[..., None] if a.ndim == 3 else a[..., None, None])
        for j in range(k_t.shape[1]):
            u = b_t[:, j, :, None] * (v_t[:, j] - jnp.einsum("BNH,BNHE->BNE", k_t[:, j], S))
            S = S + jnp.einsum("BNH,BNE->BNHE", k_t[:, j], u)
        return S, jnp.einsum("BNH,BNHE->BNE", q_t, S)

    xs = [None if x is None else jnp.moveaxis(x, 1, 0) for x in (qn, kn, v, beta, log_gates)]
    S0 = jnp.zeros((B, N, H, E), q.dtype) if initial_state is None else initial_state
    S, out = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(out, 0, 1), S


def dplr_delta_rule(q, k, v, a, b, log_w, *, scale: float, initial_state=None):
    """The DPLR delta rule as a scan over tokens, from ``attn.linear.dplr``'s equations:
    ``S <- (diag(w) + b a^T) S + k v^T`` with ``w = exp(log_w)``, then read
    ``S^T (scale q)``, from ``initial_state [B,N,H,E]`` (zeros if None); returns the outputs
    and the final state ``[B,N,H,E]``.

    q, k ``[B,T,K,H]``; v ``[B,T,N,E]``; a, b ``[B,T,K|N,H]``; log_w ``[B,T,N,H]``; value
    head n reads and writes with q/k head ``n // G``.
    """
    B, _, _, H = q.shape
    N, E = v.shape[-2:]
    q, k, a, b = (jnp.repeat(x, N // x.shape[2], axis=2) for x in (q * scale, k, a, b))

    def step(S, x):
        q_t, k_t, v_t, a_t, b_t, lw_t = x
        read = jnp.einsum("BNH,BNHE->BNE", a_t, S)  # a^T S
        S = (jnp.exp(lw_t)[..., None] * S + jnp.einsum("BNH,BNE->BNHE", b_t, read)
             + jnp.einsum("BNH,BNE->BNHE", k_t, v_t))  # fmt: skip
        return S, jnp.einsum("BNH,BNHE->BNE", q_t, S)

    xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, a, b, log_w)]
    S0 = jnp.zeros((B, N, H, E), q.dtype) if initial_state is None else initial_state
    S, out = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(out, 0, 1), S


def fenwick_levels(T: int, L: int, t=None):
    """``level(t, s) = bit_length(t XOR s)`` clamped to ``L - 1``: ``[T, T]`` for every query
    t (or ``[T]`` for the one ``t``); entries with s > t are meaningless (masked)."""
    s = np.arange(T)
    t = np.arange(T)[:, None] if t is None else np.asarray(t)
    x = np.bitwise_xor(t, s)
    bits = np.where(x > 0, np.floor(np.log2(np.maximum(x, 1))).astype(int) + 1, 0)
    return np.minimum(bits, L - 1)


def log_linear_attention(q, k, v, log_a, lam, *, scale: float):
    """Log-linear attention, the masked quadratic sum of ``attn.linear.log_linear``:
    ``o_t = sum_{s<=t} lam_t^(level(t,s)) exp(sum_{r=s+1..t} log_a_r) (scale q_t . k_s)
    v_s``, and the final Fenwick states: level l holds ``sum_s k_s v_s^T``, decayed to the
    last token, over the s with ``level(T-1, s) = l``.

    q, k ``[B,T,K,H]``, v ``[B,T,N,E]``, log_a ``[B,T,N]``, lam ``[B,T,N,L]``.
    """
    T, L = q.shape[1], lam.shape[-1]
    G = v.shape[2] // q.shape[2]
    q, k = jnp.repeat(q * scale, G, axis=2), jnp.repeat(k, G, axis=2)
    cum = jnp.cumsum(log_a, axis=1)
    causal = np.tril(np.ones((T, T), bool))[None, :, :, None]
    decay = jnp.exp(jnp.where(causal, cum[:, :, None] - cum[:, None], -jnp.inf))  # [B,T,S,N]
    onehot = np.eye(L)[fenwick_levels(T, L)]  # [T,S,L]
    weight = jnp.einsum("BTNL,TSL->BTSN", lam, onehot)
    out = jnp.einsum("BTSN,BTNH,BSNH,BSNE->BTNE", decay * weight, q, k, v)
    last = jnp.exp(cum[:, -1:] - cum)  # [B,S,N]
    top = np.eye(L)[fenwick_levels(T, L, T - 1)]  # [S,L]
    levels = jnp.einsum("BSN,SL,BSNH,BSNE->BNLHE", last, top, k, v)
    return out, levels


def log_linear_delta_rule(q, k, v, beta, lam, log_g, *, scale: float):
    """Log-linear Gated DeltaNet from ``attn.linear.log_linear``'s equation
    ``o_t = sum_{s<=t} lam_t^(level(t,s)) (q_t^T Phi(s->t) k_s) beta_s v_s`` with
    ``Phi(s->t) = A_t ... A_{s+1}``, ``A_r = exp(g_r) (I - beta_r k_r k_r^T)``: a scan over
    tokens applies ``A_t`` to every earlier key, row t of the scores is ``scale q_t`` against
    them. The final Fenwick states: level l holds ``sum_s Phi(s->T-1) k_s beta_s v_s^T`` over
    the s with ``level(T-1, s) = l``.

    q, k ``[B,T,K,H]``; v ``[B,T,N,E]``; beta, log_g ``[B,T,N]``; lam ``[B,T,N,L]``.
    """
    T, L = q.shape[1], lam.shape[-1]
    G = v.shape[2] // q.shape[2]
    q, k = jnp.repeat(q * scale, G, axis=2), jnp.repeat(k, G, axis=2)
    order = jnp.arange(T)

    def step(keys, x):  # keys [B,S,N,H]: key s carried by A_{s+1} .. A_{t-1}
        t, q_t, k_t, b_t, g_t = x
        proj = jnp.einsum("BSNH,BNH->BSN", keys, k_t)
        moved = jnp.exp(g_t)[:, None, :, None] * (keys - (b_t[:, None] * proj)[..., None]
                                                  * k_t[:, None])  # fmt: skip
        keys = jnp.where((order < t)[None, :, None, None], moved, keys)
        return keys, jnp.einsum("BNH,BSNH->BSN", q_t, keys)

    xs = (order, *(jnp.moveaxis(x, 1, 0) for x in (q, k, beta, log_g)))
    keys, scores = jax.lax.scan(step, k, xs)  # scores [T,B,S,N]
    causal = np.tril(np.ones((T, T), bool))[:, None, :, None]
    onehot = np.eye(L)[fenwick_levels(T, L)]  # [T,S,L]
    weight = jnp.einsum("BTNL,TSL->TBSN", lam, onehot)
    scores = jnp.where(causal, scores * weight, 0.0)
    out = jnp.einsum("TBSN,BSN,BSNE->BTNE", scores, beta, v)
    top = np.eye(L)[fenwick_levels(T, L, T - 1)]  # [S,L]
    levels = jnp.einsum("SL,BSNH,BSN,BSNE->BNLHE", top, keys, beta, v)
    return out, levels
