"""Helpers shared by the tests: random inputs, error measures, a float64 oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def rel_err(a, b) -> float:
    """Norm-wise relative error ``||a - b|| / ||b||`` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def normal(seed, shape, dtype=jnp.float32):
    """A standard normal array from NumPy (no JAX compile per shape, unlike jax.random)."""
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return jnp.asarray(x).astype(dtype)


def qkv(seed, B=2, T=8, S=None, N=4, K=None, H=8, E=None, dtype=jnp.float32):
    """Random q ``[B,T,N,H]``, k ``[B,S,K,H]``, v ``[B,S,K,E]``."""
    S, K, E = S or T, K or N, E or H
    return (
        normal((seed, 0), (B, T, N, H), dtype),
        normal((seed, 1), (B, S, K, H), dtype),
        normal((seed, 2), (B, S, K, E), dtype),
    )


def np_attention(q, k, v, allowed=None, *, scale=None, softcap=None, sink_logits=None):
    """Float64 NumPy softmax attention; rows with nothing visible give zeros.

    Args:
      q ``[B,T,N,H]``, k ``[B,S,K,H]``, v ``[B,S,K,E]``; allowed ``[B,T,S]`` bool or None.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    K = k.shape[2]
    rep = N // K
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * (H**-0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    ok = np.ones((B, 1, T, k.shape[1]), bool) if allowed is None else np.asarray(allowed)[:, None]
    s = np.where(ok, s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sink_logits is not None:
        m = np.maximum(m, np.asarray(sink_logits, np.float64)[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(ok, np.exp(s - m), 0.0)
    den = p.sum(-1, keepdims=True)
    if sink_logits is not None:
        den = den + np.exp(np.asarray(sink_logits, np.float64)[None, :, None, None] - m)
    w = p / np.where(den == 0, 1.0, den)
    return np.einsum("bnts,bsne->btne", w, v)


def mesh_of(num_devices: int, explicit: bool = False, axis: str = "seq"):
    """A one-axis mesh of the first devices: Auto axis types (``Mesh``) or Explicit ones
    (``jax.make_mesh``)."""
    import jax
    from jax.sharding import AxisType, Mesh

    devices = jax.devices()[:num_devices]
    if explicit:
        mesh = jax.make_mesh((num_devices,), (axis,), devices=devices)
        assert mesh.axis_types == (AxisType.Explicit,)
        return mesh
    return Mesh(np.array(devices), (axis,))
