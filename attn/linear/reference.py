"""Float64 references of the fixed-state families, written from their papers' equations.

One reference per family, as plainly as the equations read (a scan over
tokens, or the masked quadratic sum), never the forms' algorithms: the tests,
``bench/_delta.py`` and the device numerics (``bench/_device_numerics.py``)
compare every form with these. They are plain JAX, so ``jax.grad`` of them is
the gradient oracle; run them on float64 arrays under ``jax.enable_x64(True)``.
Segments are not theirs to know: ``each_segment`` (``each_segment_jnp``, for
gradients) runs a reference on each packed segment alone.

Axes as ``attn``'s: value head n reads and writes with query/key head ``n // G``
(``G = N // K``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attn.linear.reference_ttt import mesa_net, titans, ttt

__all__ = [
    "comba",
    "delta_rule",
    "dplr_delta_rule",
    "each_segment",
    "each_segment_jnp",
    "feature_map",
    "fenwick_levels",
    "gated_linear",
    "log_linear_attention",
    "log_linear_delta_rule",
    "mesa_net",
    "segment_runs",
    "ssd",
    "titans",
    "ttt",
]


def feature_map(name: str, x, projection=None):
    """Linear attention's feature maps ``phi: x [..., H] -> [..., F]``, from their papers:
    ``"identity"``; ``"elu1"``, ``elu(x) + 1`` (Katharopoulos et al.); ``"relu"``;
    ``"silu"``, ``x sigmoid(x)`` (MiniMax-01's lightning attention); ``"taylor"``,
    ``[1, x, x (x) x / sqrt(2)]`` (Based); ``"favor"``, ``exp(x W - |x|^2 / 2) / sqrt(F)``
    with ``W = projection [H, F]`` (Performer's FAVOR+)."""
    x = jnp.asarray(x)
    if name == "identity":
        return x
    if name == "elu1":
        return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))
    if name == "relu":
        return jnp.maximum(x, 0.0)
    if name == "silu":
        return x / (1.0 + jnp.exp(-x))
    if name == "taylor":
        outer = (x[..., :, None] * x[..., None, :]).reshape(*x.shape[:-1], -1)
        return jnp.concatenate([jnp.ones_like(x[..., :1]), x, outer / np.sqrt(2.0)], -1)
    if name == "favor":
        w = jnp.asarray(projection, x.dtype)
        return jnp.exp(x @ w - 0.5 * jnp.sum(x * x, -1, keepdims=True)) / np.sqrt(w.shape[1])
    raise ValueError(f"name: expected identity, elu1, relu, silu, taylor or favor, got {name!r}")


def gated_linear(qf, kf, v, log_a=None, *, normalize: bool, eps: float = 1e-6, initial_state=None):
    """Causal linear attention with per-token gates as a scan over tokens: ``kv <- a_t kv +
    kf_t v_t^T`` and ``z <- a_t z + kf_t`` with ``a_t = exp(log_a_t)`` (1 without gates; 0
    erases), then ``out_t = qf_t^T kv`` (over ``qf_t . z + eps`` if normalized), from
    ``initial_state = (kv [B,N,F,E], z [B,N,F])`` (zeros if None). Returns out ``[B,T,N,E]``
    and the final kv and z.

    qf, kf ``[B,T,N,F]`` (features, per head), v ``[B,T,N,E]``, log_a ``[B,T,N]`` or None.
    """
    B, _, N, F = qf.shape
    if log_a is None:
        log_a = jnp.zeros(qf.shape[:3], qf.dtype)
    if initial_state is None:
        initial_state = (jnp.zeros((B, N, F, v.shape[-1])), jnp.zeros((B, N, F)))

    def step(carry, x):
        kv, z = carry
        q_t, k_t, v_t, log_a_t = x
        a = jnp.exp(log_a_t)
        kv = a[..., None, None] * kv + jnp.einsum("BNF,BNE->BNFE", k_t, v_t)
        z = a[..., None] * z + k_t
        out = jnp.einsum("BNF,BNFE->BNE", q_t, kv)
        if normalize:
            out = out / (jnp.einsum("BNF,BNF->BN", q_t, z)[..., None] + eps)
        return (kv, z), out

    xs = [jnp.moveaxis(x, 1, 0) for x in (qf, kf, v, log_a)]
    carry = tuple(jnp.asarray(x, qf.dtype) for x in initial_state)
    (kv, z), out = jax.lax.scan(step, carry, xs)
    return jnp.moveaxis(out, 0, 1), kv, z


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


def ssd(x, dt, A, B, C, D=None, *, initial_state=None, negative_eigenvalues: bool = False):
    """Mamba-2's SSD as a scan over tokens, from its recurrence per head: ``h <- a_t h + B_t
    (dt_t x_t)^T`` and ``y_t = h^T C_t + D x_t``, with ``a_t = exp(dt_t A)`` or, with negative
    eigenvalues, ``2 exp(dt_t A) - 1`` (Grazzi et al.), from ``initial_state [B,N,H,E]``
    (zeros if None). Returns y ``[B,T,N,E]`` and the final state ``[B,N,H,E]``.

    ``attn.ssd``'s arguments: x ``[B,T,N,E]``, dt ``[B,T,N]``, A ``[N]`` (``-exp(A_log)``),
    B, C ``[B,T,K,H]`` (head n reads group ``n // G``), D ``[N]`` or None.
    """
    batch, _, N, E = x.shape
    B, C = (jnp.repeat(m, N // m.shape[2], axis=2) for m in (B, C))

    def step(h, xs):
        x_t, dt_t, B_t, C_t = xs
        a = jnp.exp(dt_t * A)
        if negative_eigenvalues:
            a = 2.0 * a - 1.0
        h = a[..., None, None] * h + jnp.einsum("bnh,bne->bnhe", B_t, dt_t[..., None] * x_t)
        return h, jnp.einsum("bnh,bnhe->bne", C_t, h)

    h0 = jnp.zeros((batch, N, B.shape[-1], E)) if initial_state is None else initial_state
    xs = [jnp.moveaxis(m, 1, 0) for m in (x, dt, B, C)]
    h, y = jax.lax.scan(step, jnp.asarray(h0, x.dtype), xs)
    y = jnp.moveaxis(y, 0, 1)
    return (y if D is None else y + D[:, None] * x), h


def comba(q, k, v, p, beta, log_gates=None, *, scale: float, initial_state=None):
    """Comba (Hu et al. 2025) as a scan over tokens, from ``attn.linear.comba``'s equations:
    the error ``u = v - S^T p`` read before the decay, then ``S <- exp(g) S + beta k u^T``,
    then read ``S^T (scale q)``, from ``initial_state [B,N,H,E]`` (zeros if None); returns
    the outputs and the final state.

    q, k, p ``[B,T,K,H]``; v ``[B,T,N,E]``; beta ``[B,T,N]``; log_gates None or
    ``[B,T,N]``; value head n reads and writes with q/k head ``n // G``.
    """
    B, _, _, H = q.shape
    N, E = v.shape[-2:]
    q, k, p = (jnp.repeat(x, N // x.shape[2], axis=2) for x in (q * scale, k, p))
    g = jnp.zeros(beta.shape, q.dtype) if log_gates is None else log_gates

    def step(S, x):
        q_t, k_t, v_t, p_t, b_t, g_t = x
        u = v_t - jnp.einsum("BNH,BNHE->BNE", p_t, S)
        S = jnp.exp(g_t)[..., None, None] * S + jnp.einsum("BNH,BNE->BNHE", k_t,
                                                            b_t[..., None] * u)  # fmt: skip
        return S, jnp.einsum("BNH,BNHE->BNE", q_t, S)

    xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, p, beta, g)]
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


def segment_runs(ids_row) -> list[list[int]]:
    """The token indices of each segment of one row of ids: runs of equal non-zero ids,
    padding (id 0) skipped inside a run; an id that comes back after another starts a
    new segment."""
    runs, current = [], None
    for t, i in enumerate(np.asarray(ids_row).tolist()):
        if i == 0:
            continue
        if i != current:
            runs.append([])
            current = i
        runs[-1].append(t)
    return runs


def each_segment(fn, ids, *arrays, initial_state=None, **kwargs):
    """``each_segment_jnp``'s outputs and final states as NumPy arrays."""
    out = each_segment_jnp(fn, ids, *arrays, initial_state=initial_state, **kwargs)
    return tuple(np.asarray(x) for x in out)


def each_segment_jnp(fn, ids, *arrays, initial_state=None, **kwargs):
    """A reference ``fn(*arrays, **kwargs) -> (out [B,T,...], state [B,...])`` run on each
    segment (``segment_runs``) of each row of ``ids [B,T]`` alone: the outputs, zero at
    padding, and each row's last segment's final state. With ``initial_state [B,...]``,
    each row's first segment continues from its row (fn's ``initial_state``), the others
    start from nothing and a row with no segment keeps it; without, such a row's state is
    zeros. Arrays may be None. Plain JAX: ``jax.grad`` of it is differentiable."""
    arrays = [None if x is None else jnp.asarray(x) for x in arrays]
    B, T = np.shape(ids)
    pieces, states = [], {}
    for b, row in enumerate(np.asarray(ids)):
        for i, tokens in enumerate(segment_runs(row)):
            at, kw = np.asarray(tokens), dict(kwargs)
            if initial_state is not None and i == 0:
                kw["initial_state"] = initial_state[b : b + 1]
            out, state = fn(*(None if x is None else x[b : b + 1, at] for x in arrays), **kw)
            pieces.append((b, at, out[0]))
            states[b] = state[0]
    if not pieces:
        raise ValueError("ids: expected at least one real (non-zero) id, got only padding")
    like, state_like = pieces[0][2], next(iter(states.values()))
    out = jnp.zeros((B, T, *like.shape[1:]), like.dtype)
    for b, at, piece in pieces:
        out = out.at[b, at].set(piece)
    if initial_state is None:
        kept = jnp.zeros((B, *state_like.shape), state_like.dtype)
    else:
        kept = jnp.asarray(initial_state, state_like.dtype)
    return out, jnp.stack([states.get(b, kept[b]) for b in range(B)])
