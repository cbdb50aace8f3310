"""Selection scores that are the same bits whatever the shapes around them.

A top-k selection flips at a near tie when two computations of one score round
differently, and a forward pass, a prefill chunk and a decode step compute with
other shapes (a matmul's summation order follows them). The sparse methods
therefore rank dot products of 8-bit operands: each vector is rounded to
integers of magnitude at most 128 times a power of two (a shared exponent, as
in the MX formats; DeepSeek runs its indexer in FP8). The dot product of two
such vectors is a sum of integer products, at most ``2**24`` for up to
``MAX_DIM`` terms: exact in float32 in any summation order, on any matmul unit
(bfloat16 and TF32 hold such integers exactly). The scales then multiply
elementwise, so the score is the same bits in any batch, chunk or cache.
"""

from __future__ import annotations

import jax.numpy as jnp

from attn.checks import fail

LEVELS = 128
MAX_DIM = 2**24 // LEVELS**2  # the longest exact dot product


def int8(x):
    """``x [..., F]`` as ``(integers of magnitude <= 128 held in float32, scale [...])``, the
    scale the power of two putting the largest magnitude in ``[64, 128)``."""
    x = x.astype(jnp.float32)
    _, exponent = jnp.frexp(jnp.abs(x).max(-1))  # a max is exact in any order
    scale = jnp.ldexp(jnp.float32(1), exponent - 7)
    return jnp.round(x / scale[..., None]), scale


def check_dim(F: int, name: str, shape) -> None:
    """Refuses vectors longer than an exact dot product allows."""
    if F > MAX_DIM:
        fail(name, f"a last axis of at most {MAX_DIM} (the exact 8-bit scores)", shape)
