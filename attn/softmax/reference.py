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


def softmax(q, k, v, ok, *, scale, softcap=None, sinks=None):
    """``softmax(q k^T scale)`` over the keys ``ok [B,1|N,T,S]`` allows, with Gemma's soft-cap
    and gpt-oss's sink logits ``[N]`` (a logit in each denominator with no value); a row that
    sees nothing gives zeros. GQA by repeating k and v."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("BTNH,BSNH->BNTS", q, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(ok, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(ok, jnp.exp(jnp.where(ok, s - m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.exp(sinks[None, :, None, None] - m)
    return jnp.einsum("BNTS,BSNE->BTNE", p / jnp.where(den == 0, 1.0, den), v)


def path_attention(q, k, v, w, beta, log_forget, *, scale: float):
    """PaTH attention from ``attn.softmax.path``'s equation: the logit of query i on key
    ``j <= i`` is ``scale q_i^T H_i ... H_{j+1} k_j + sum_{l=j+1..i} log_forget_l`` with
    ``H_s = I - beta_s w_s w_s^T`` (a scan over tokens applies ``H_t`` to every earlier
    key), then causal softmax.

    q ``[B,T,N,H]``; k, w ``[B,T,K,H]``; v ``[B,T,K,E]``; beta ``[B,T,K]``; log_forget
    ``[B,T,N]``.
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
    c = jnp.cumsum(log_forget, axis=1)  # [B,T,N]
    s = s + jnp.moveaxis(c, 1, 2)[..., :, None] - jnp.moveaxis(c, 1, 2)[..., None, :]
    causal = np.tril(np.ones((T, T), bool))
    s = jnp.where(causal, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("BNTS,BSNE->BTNE", p, jnp.repeat(v, G, axis=2))
