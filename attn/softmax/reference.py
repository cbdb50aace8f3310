"""Float64 references of softmax attention and PaTH, written from the equations.

Plain JAX, as ``attn.linear.reference``: run on float64 arrays under
``jax.enable_x64(True)``, ``jax.grad`` of them is the gradient oracle. The
device numerics (``bench/_device_numerics.py``) compare every implementation
with these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["path_attention", "softmax"]


def _masked_softmax(s, ok, sinks=None):
    """The softmax of the logits ``s [B,N,T,S]`` over the keys ``ok`` allows, with the sink
    logits ``[N]`` in each denominator: the probabilities (zeros in a row that sees nothing)
    and the log-sum-exps ``[B,N,T]`` (-inf there). The max is held constant (the softmax
    does not depend on it), so no -inf enters the differentiated path."""
    m = jnp.where(ok, s, -jnp.inf).max(-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(ok, jnp.exp(jnp.where(ok, s - m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.exp(sinks[None, :, None, None] - m)
    safe = jnp.where(den > 0, den, 1.0)
    return p / safe, jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)[..., 0]


def softmax(q, k, v, ok, *, scale, softcap=None, sinks=None):
    """``softmax(q k^T scale)`` over the keys ``ok [B,1|N,T,S]`` allows, with Gemma's soft-cap
    and gpt-oss's sink logits ``[N]`` (a logit in each denominator with no value); a row that
    sees nothing gives zeros. GQA by repeating k and v."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("BTNH,BSNH->BNTS", q, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    p, _ = _masked_softmax(s, ok, sinks)
    return jnp.einsum("BNTS,BSNE->BTNE", p, v)


def path_attention(
    q, k, v, w, beta, log_forget=None, *, scale: float, ok=None, return_lse: bool = False
):
    """PaTH attention from ``attn.softmax.path``'s equation: the logit of query i on key
    ``j <= i`` is ``scale q_i^T H_i ... H_{j+1} k_j + sum_{l=j+1..i} log_forget_l`` with
    ``H_s = I - beta_s w_s w_s^T`` (a scan over tokens applies ``H_t`` to every earlier
    key), then softmax over the causal keys ``ok [B,1|N,T,T]`` allows (all if None); a row
    that sees nothing gives zeros. Returns out ``[B,T,N,E]``, with ``return_lse`` also the
    log-sum-exps ``[B,T,N]`` (-inf where a row sees nothing). Padding is a token whose H is
    I and whose gate is 0 (beta = 0, log_forget = 0) that no query sees or is seen by.

    q ``[B,T,N,H]``; k, w ``[B,T,K,H]``; v ``[B,T,K,E]``; beta ``[B,T,K]``; log_forget
    ``[B,T,N]`` or None.
    """
    T = q.shape[1]
    G = q.shape[2] // k.shape[2]
    order = jnp.arange(T)

    def step(keys, x):  # keys [B,S,K,H]: key j carried by H_{j+1} .. H_{t-1}
        t, w_t, b_t = x
        proj = jnp.einsum("BSKH,BKH->BSK", keys, w_t)
        moved = keys - (b_t[:, None] * proj)[..., None] * w_t[:, None]
        keys = jnp.where((order < t)[None, :, None, None], moved, keys)
        return keys, keys

    xs = (order, *(jnp.moveaxis(x, 1, 0) for x in (w, beta)))
    _, keys = jax.lax.scan(step, k, xs)  # [T,B,S,K,H]: the keys as query t reads them
    keys = jnp.repeat(keys, G, axis=3)
    s = jnp.einsum("BTNH,TBSNH->BNTS", q, keys) * scale
    if log_forget is not None:
        c = jnp.moveaxis(jnp.cumsum(log_forget, axis=1), 1, 2)  # [B,N,T]
        s = s + c[..., :, None] - c[..., None, :]
    allowed = np.tril(np.ones((T, T), bool))
    p, lse = _masked_softmax(s, allowed if ok is None else allowed & ok)
    out = jnp.einsum("BNTS,BSNE->BTNE", p, jnp.repeat(v, G, axis=2))
    return (out, jnp.moveaxis(lse, 1, 2)) if return_lse else out
