"""Rotary position embedding (RoPE, Su et al. 2021).

Pairs of channels are rotated by ``position * theta_i`` with
``theta_i = base ** (-2i / rotary_dim)``. A query rotated at position m and a
key rotated at position n then have a dot product that depends only on
``m - n``: relative position enters exactly where tokens interact.
"""

from __future__ import annotations

import jax.numpy as jnp

from attn.checks import fail

LAYOUTS = ("half", "interleaved")


def rope_frequencies(rotary_dim: int, base: float = 10000.0):
    """Float32 ``[rotary_dim // 2]`` angular frequencies ``base ** (-2i / rotary_dim)``."""
    return base ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)


def apply_rope(
    x, positions, *, base: float = 10000.0, rotary_dim: int | None = None, layout: str = "half"
):
    """Rotates the first ``rotary_dim`` channels of each head by its position.

    Args:
      x: ``[B,T,N,H]`` queries or keys.
      positions: ``[T]`` or ``[B,T]`` integer (or float) positions.
      base: the frequency base (10000 in the paper; Llama 3 uses 500000).
      rotary_dim: how many leading channels rotate (even, <= H); the rest pass
        through unchanged (partial RoPE, e.g. GPT-NeoX). Default: all H.
      layout: ``"half"`` pairs channel i with i + rotary_dim/2 (GPT-NeoX, Llama
        in Hugging Face); ``"interleaved"`` pairs 2i with 2i+1 (the paper, GPT-J).

    Returns:
      ``[B,T,N,H]`` in x's dtype; the rotation is computed in float32.
    """
    if getattr(x, "ndim", None) != 4:
        fail("x", "a rank-4 array [B,T,N,H]", getattr(x, "shape", type(x).__name__))
    B, T, _, H = x.shape
    if rotary_dim is None:
        if H % 2:  # the default rotates every channel, in pairs
            fail("x", "an even head dim H (or pass an even rotary_dim < H)", f"H = {H}")
        rotary_dim = H
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > H:
        fail("rotary_dim", f"an even int in [2, {H}]", repr(rotary_dim))
    if layout not in LAYOUTS:
        fail("layout", f"one of {LAYOUTS}", repr(layout))
    if base <= 0:
        fail("base", "a positive float", repr(base))
    positions = jnp.asarray(positions)
    if positions.shape not in ((T,), (B, T)):
        fail("positions", f"shape ({T},) or ({B}, {T})", positions.shape)
    positions = jnp.broadcast_to(positions, (B, T)).astype(jnp.float32)

    angle = positions[:, :, None, None] * rope_frequencies(rotary_dim, base)  # [B,T,1,R/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xr, rest = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
    if layout == "half":
        a, b = jnp.split(xr, 2, axis=-1)
        rotated = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(xr.shape)
    return jnp.concatenate([rotated.astype(x.dtype), rest], axis=-1)
