"""Selection scores that are the same bits whatever the shapes around them.

A top-k selection flips at a near tie when two computations of one score round
differently, and a forward pass, a prefill chunk and a decode step compute with
other shapes (a matmul's or a reduction's summation order follows them). Two
ways keep a score's bits fixed, each where its method's authors put the score:

* ``tree_sum``: a float32 sum in one fixed pairwise order (each slot adds the
  slot half the width above it), written as elementwise adds that no compiler
  reorders. MoBA's gate (``q . mean(k)`` in float32, as its paper and its naive
  code compute it) is products then this sum, and its block sums are this sum
  over a block's slots: the same bits in a forward pass, a prefill and a cache.
* ``int8``: dot products of 8-bit operands (integers of magnitude at most 128
  times a shared power of two, as in the MX formats), for DSA's lightning
  indexer, which its paper runs in FP8. Such a dot product is a sum of integer
  products, at most ``2**24`` for up to ``MAX_DIM`` terms: exact in float32 in
  any summation order, on any matmul unit (bfloat16 and TF32 hold such integers
  exactly).
"""

from __future__ import annotations

import jax
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


def halves(n: int) -> list[int]:
    """The widths ``tree_sum`` adds at, in order: ``P/2, P/4, ..., 1`` for ``P`` the power of
    two at least ``n``."""
    return [1 << i for i in reversed(range(max(n - 1, 0).bit_length()))]


def tree_sum(x, axis: int = -1):
    """``x`` summed over ``axis`` in one fixed order: zero-padded to a power of two ``P``
    slots, slot ``i`` adds slot ``i + h`` for ``h = P/2, ..., 1``; float32."""
    x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    n = x.shape[-1]
    if n == 0:
        return jnp.zeros(x.shape[:-1], jnp.float32)
    widths = halves(n)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 2 * widths[0] - n if widths else 0)])
    for h in widths:
        x = x[..., :h] + x[..., h : 2 * h]
    return x[..., 0]


def tree_dot(a, b):
    """``sum(a * b, -1)`` in float32 in ``tree_sum``'s order. The products are kept apart
    from the sum (an optimization barrier), so no backend fuses a product into an add
    (a fused multiply-add rounds once where the two ops round twice)."""
    products = jax.lax.optimization_barrier(a.astype(jnp.float32) * b.astype(jnp.float32))
    return tree_sum(products, -1)
